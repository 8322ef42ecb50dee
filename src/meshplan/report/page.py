"""The report page: one self-contained HTML document (inline CSS, SVG and a little JS).

The page needs no network. Its script only adds table sorting and a time cursor on the
timeline; the figures are plain SVG drawn here. The first script records every JavaScript
error into ``<html data-js-errors>`` (a JSON list); the last one counts the drawn marks of
each figure into ``data-rendered-marks`` and sets ``<html data-ready="1">`` (the browser test
reads both).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from meshplan import __version__
from meshplan.report import charts
from meshplan.search.explain import TERM_LABELS, explain, rejection_lines
from meshplan.search.result import SearchResult
from meshplan.sim.engine import STREAMS
from meshplan.sim.output import STREAM_NAMES
from meshplan.spec.base import json_safe
from meshplan.spec.graph import LayerGraph
from meshplan.spec.lengths import workload_text
from meshplan.svg import esc, fixed3, plot_css
from meshplan.units import human_count

CSS = """
:root{--fg:#1d2330;--mut:#5b6475;--line:#d9dde5;--bg:#fff;--panel:#f6f7f9;--acc:#2f5fa7;--bad:#b3261e;--ok:#2e7d32}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
 color:var(--fg);background:var(--bg)}
main{max-width:1060px;margin:0 auto;padding:20px 24px 60px}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:17px;margin:30px 0 8px;padding-top:8px;border-top:1px solid var(--line)}
h3{font-size:14px;margin:16px 0 6px}
p{margin:6px 0}.mut{color:var(--mut)}
code{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;overflow-wrap:anywhere}
nav a{color:var(--acc);margin-right:12px;text-decoration:none;font-size:13px}
.verdict{border-left:4px solid var(--ok);background:var(--panel);padding:10px 14px;margin:14px 0}
.verdict.bad{border-left-color:var(--bad)}
.verdict .big{font-size:16px;font-weight:600}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0}
dl.facts dt{color:var(--mut)}dl.facts dd{margin:0}
.cols{display:flex;flex-wrap:wrap;gap:14px}.cols>div{flex:1 1 300px}
table{border-collapse:collapse;width:100%;font-size:13px;margin:6px 0}
th,td{padding:4px 8px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top}
th{background:var(--panel);font-weight:600;white-space:nowrap}
th[data-sort]{cursor:pointer}th[data-sort]:after{content:" \\2195";color:#aab}
td.l,th.l{text-align:left}td.plan{min-width:220px}.wide{overflow-x:auto}td code{overflow-wrap:normal}
tr.win td{background:#fff8dc}
ul{margin:6px 0;padding-left:20px}li{margin:3px 0}
svg.plot{display:block;max-width:100%;height:auto;margin:6px 0;font-family:inherit}
""" + plot_css() + """
.pair{display:flex;flex-wrap:wrap;gap:8px}.pair svg{flex:1 1 460px}
details{margin:8px 0}summary{cursor:pointer;color:var(--acc)}
footer{margin-top:40px;color:var(--mut);font-size:12px}
"""

# Runs first: every error (script errors, resources that fail to load, failed promises,
# console.error) is recorded.
JS_GUARD = """(function(){var d=document.documentElement,errs=[];
function rec(m){errs.push(String(m));d.setAttribute('data-js-errors',JSON.stringify(errs));}
d.setAttribute('data-js-errors','[]');
window.addEventListener('error',function(e){var t=e.target;
if(t&&t!==window&&(t.src||t.href)){rec('failed to load '+(t.src||t.href));return;}
rec((e.message||'error')+(e.lineno?' (line '+e.lineno+')':''));},true);
window.addEventListener('unhandledrejection',function(e){rec('unhandled rejection: '+e.reason);});
var ce=console.error;console.error=function(){rec(Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments);};})();"""

JS_MAIN = """(function(){
function val(td){var v=td.getAttribute('data-v');return v===null?td.textContent:v;}
document.querySelectorAll('table.sortable').forEach(function(t){
 t.querySelectorAll('th[data-sort]').forEach(function(th,ci){th.addEventListener('click',function(){
  var col=Array.prototype.indexOf.call(th.parentNode.children,th),num=th.getAttribute('data-sort')==='num';
  var dir=th.getAttribute('data-dir')==='asc'?-1:1;th.setAttribute('data-dir',dir>0?'asc':'desc');
  var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows);
  rows.sort(function(a,b){var x=val(a.cells[col]),y=val(b.cells[col]);
   if(num){x=parseFloat(x);y=parseFloat(y);return dir*((x>y)-(x<y));}return dir*String(x).localeCompare(String(y));});
  rows.forEach(function(r){body.appendChild(r);});});});});
var g=document.querySelector('svg[data-plot="gantt"]');
if(g){var cur=g.querySelector('.cursor'),lab=g.querySelector('.cursor-label');
 var x0=parseFloat(g.getAttribute('data-x0')),x1=parseFloat(g.getAttribute('data-x1')),
 t1=parseFloat(g.getAttribute('data-t1'));
 g.addEventListener('mousemove',function(ev){var p=g.createSVGPoint();p.x=ev.clientX;p.y=ev.clientY;
  var q=p.matrixTransform(g.getScreenCTM().inverse());if(q.x<x0||q.x>x1){cur.setAttribute('visibility','hidden');
  lab.setAttribute('visibility','hidden');return;}
  cur.setAttribute('x1',q.x);cur.setAttribute('x2',q.x);lab.setAttribute('x',q.x+3);
  lab.textContent=((q.x-x0)/(x1-x0)*t1).toFixed(4)+' s';
  cur.setAttribute('visibility','visible');lab.setAttribute('visibility','visible');});}
document.querySelectorAll('svg[data-plot]').forEach(function(s){var n=0;
 s.querySelectorAll('[data-mark]').forEach(function(m){var r=m.getBoundingClientRect();if(r.width>0||r.height>0)n++;});
 s.setAttribute('data-rendered-marks',String(n));});
document.documentElement.setAttribute('data-ready','1');})();"""


def _plan(text: str) -> str:
    """A plan string that may wrap after its commas."""
    return "<code>" + ",<wbr>".join(esc(p) for p in text.split(",")) + "</code>"


def json_script(doc: Any) -> str:
    text = json.dumps(json_safe(doc), allow_nan=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="meshplan-data">{text}</script>'


def _facts(items: list[tuple[str, str]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


# ---- sections ------------------------------------------------------------------------------

def _model_facts(m: Any) -> list[tuple[str, str]]:
    """The model's shape: the transformer description a graph was generated from (its
    ``LayerGraph.model``), or a traced graph's layers."""
    if isinstance(m, LayerGraph) and m.model is not None:
        m = m.model
    if isinstance(m, LayerGraph):
        blocks = m.distinct_blocks()
        kinds = [x.kind for x in m.layers]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("embedding", "block", "head", "other") if k in kinds)
        tp = [x for x in m.layers if x.tp_style != "none" and x.tp_fraction > 0]
        return [("model", f"<b>{esc(m.name)}</b>, {human_count(m.params)} parameters (layer graph of "
                          f"<code>{esc(m.source)}</code>, task {esc(m.task)})"),
                ("layers", f"{m.num_layers} ({counts}; {len(blocks)} distinct)"),
                ("FLOPs per sample", f"{human_count(m.fwd_flops)} forward + {human_count(m.bwd_flops)} backward, at "
                                     f"{m.sample_tokens:,} tokens per sample"),
                ("tensor parallel", f"{len(tp)} of {m.num_layers} layers split; degrees "
                                    + ", ".join(map(str, m.tp_degrees(64))))]
    heads = f"{m.num_attention_heads}" + (f" ({m.kv_heads} KV)" if m.kv_heads != m.num_attention_heads else "")
    model = [("model", f"<b>{esc(m.name)}</b>, {human_count(m.num_params())} parameters"
              + (f" ({human_count(m.num_active_params())} active)" if m.is_moe else "")),
             ("layers / hidden / heads", f"{m.num_layers} / {m.hidden_size:,} / {heads}"),
             ("FFN / vocabulary", f"{m.ffn_hidden_size:,} ({esc(m.mlp_type)}) / {m.vocab_size:,}")]
    if m.is_moe:
        model.append(("experts", f"{m.num_experts}, {m.experts_per_token} per token"))
    return model


def _problem(r: SearchResult, command: str | None) -> str:
    m, c0, w = r.model, r.clusters[0], r.work
    model = _model_facts(m)
    sizes = ", ".join(f"{c.num_gpus:,}" for c in r.clusters)
    g = c0.gpu
    cluster = [("cluster", esc(c0.name) if len(r.clusters) == 1 else f"{sizes} GPUs (searched)"),
               ("GPU", f"{esc(g.name)}, {g.memory_gib:g} GiB"
                + (f", {g.peak_tflops['bf16']:g} bf16 TFLOP/s" if "bf16" in g.peak_tflops else "")),
               ("nodes", f"{c0.num_nodes} x {c0.gpus_per_node} GPUs" if len(r.clusters) == 1 else
                f"{c0.gpus_per_node} GPUs per node"),
               ("links per GPU", f"{c0.intra_node.bandwidth_gbps:g} GB/s in a node, "
                                 f"{c0.inter_node.bandwidth_gbps:g} GB/s between nodes"),
               ("price", f"${c0.price_per_hour:g} per GPU-hour")]
    if c0.inter_dc is not None and c0.num_dcs > 1:
        dc = c0.inter_dc
        cluster.insert(-1, ("datacenters", f"{c0.num_dcs} of {c0.nodes_per_dc} nodes, joined by "
                                           f"{dc.bandwidth_gbps:g} GB/s " + ("shared by every GPU that crosses"
                                                                            if dc.shared else "per GPU")
                                           + f", {dc.latency_us / 1000:g} ms"))
    if c0.step_jitter > 0:
        cluster.insert(-1, ("step jitter", f"{100 * c0.step_jitter:g}% per GPU (priced as stragglers)"))
    unit = "samples" if isinstance(m, LayerGraph) and m.model is None else "sequences"
    work = [("global batch", f"{w.global_batch:,} {unit} x {w.seq_len:,} tokens = {w.tokens:,} tokens per step"
             if w.lengths is None or len(w.lengths.lengths) == 1 else
             f"{workload_text(w)}{lengths_note(w)} = {w.tokens:,} real tokens per step"),
            ("objective", {"time": "fastest step", "cost": "fewest dollars per token",
                           "time-to-target": "soonest to a target loss (step time x token-efficiency factor)"}
             .get(r.objective, r.objective)),
            ("searched", f"{r.considered:,} plans: "
                         + (f"{r.passed_constraints:,} pass the constraints, " if r.passed_constraints >= 0 else "")
                         + f"{r.evaluated:,} priced by the cost model, {r.feasible:,} feasible, "
                         f'in <span class="timing">{r.search_time_s:.2f} s</span>')]
    if command:
        work.append(("command", f"<code>{esc(command)}</code>"))
    return ('<section id="problem"><h2>Problem</h2><div class="cols">'
            f"<div>{_facts(model)}</div><div>{_facts(cluster)}</div></div>{_facts(work)}</section>")


def _verdict(r: SearchResult, train: list[dict[str, float] | None] | None) -> str:
    c = r.clusters[-1]
    if r.best is None:
        items = "".join(f"<li>{esc(s)}</li>" for s in r.nearest) or "<li>no nearby feasible option was found</li>"
        return ('<div class="verdict bad" id="verdict"><p class="big">No plan fits</p>'
                f"<p>{esc(r.model.name)} on {c.num_gpus:,} x {esc(c.gpu.name)} with a global batch of "
                f"{r.work.global_batch:,} x {r.work.seq_len:,} tokens: all {r.considered:,} candidate plans "
                f"were rejected (reasons below).</p><p><b>What would make it feasible:</b></p><ul>{items}</ul></div>")
    b, rep = r.best, r.best.report
    t = train[0] if train else None
    extra = (f"; {t['days']:.1f} days and ${t['usd']:,.0f} to train {human_count(t['tokens'])} tokens" if t else "")
    return ('<div class="verdict" id="verdict"><p class="big">Best plan: ' + _plan(b.plan.short())
            + f" on {b.plan.num_gpus:,} GPUs</p><p>{fixed3(rep.step_time_s)} s per step, {rep.tokens_per_s:,.0f} "
            f"tokens/s, MFU {100 * rep.mfu:.1f}%, peak memory {rep.peak_memory_gib:.1f} of "
            f"{rep.usable_memory_gib:.1f} GiB usable, ${fixed3(b.usd_per_mtok)} per million tokens{esc(extra)}; "
            f"largest time term: {esc(TERM_LABELS.get(rep.dominant, rep.dominant))}.</p></div>")


def _top_table(r: SearchResult, train: list[dict[str, float] | None] | None) -> str:
    if not r.plans:
        return ""
    multi = len(r.clusters) > 1
    has_train = bool(train and train[0])
    head = [("#", "num", ""), ("plan", "text", "l plan")] + ([("GPUs", "num", "")] if multi else []) + [
        ("step time (s)", "num", ""), ("tokens/s", "num", ""), ("MFU", "num", ""), ("peak GiB", "num", ""),
        ("$ / M tokens", "num", ""), ("largest term", "text", "l")]
    weak = r.other_objective is not None or r.objective == "time-to-target"
    sites = any(c.num_dcs > 1 for c in r.clusters)
    if weak:
        head.insert(head.index(("tokens/s", "num", "")), ("to target (s)", "num", ""))
        head.insert(head.index(("tokens/s", "num", "")), ("tokens x", "num", ""))
    if sites:
        head.insert(head.index(("tokens/s", "num", "")), ("cross-site GB", "num", ""))
    if has_train:
        head += [("days", "num", ""), ("$ to train", "num", "")]
    rows = []
    for i, p in enumerate(r.plans):
        rep = p.report
        cells = [(str(p.rank), p.rank), (_plan(p.plan.short()), None)]
        if multi:
            cells.append((f"{p.plan.num_gpus:,}", p.plan.num_gpus))
        cells.append((f"{fixed3(rep.step_time_s)}", rep.step_time_s))
        if weak:
            cells += [(f"{fixed3(rep.time_to_target_s)}", rep.time_to_target_s),
                      (f"{rep.token_factor:.2f}", rep.token_factor)]
        if sites:
            cells.append((f"{rep.cross_site_gb:,.2f}", rep.cross_site_gb))
        cells += [(f"{rep.tokens_per_s:,.0f}", rep.tokens_per_s),
                  (f"{100 * rep.mfu:.1f}%", rep.mfu), (f"{rep.peak_memory_gib:.1f}", rep.peak_memory_gib),
                  (f"{fixed3(p.usd_per_mtok)}", p.usd_per_mtok),
                  (esc(TERM_LABELS.get(rep.dominant, rep.dominant)), None)]
        t = train[i] if (has_train and train and i < len(train)) else None
        if t:
            cells += [(f"{t['days']:.1f}", t["days"]), (f"{t['usd']:,.0f}", t["usd"])]
        tds = "".join(f'<td class="{h[2]}"' + (f' data-v="{float(v)!r}"' if v is not None else "") + f">{text}</td>"
                      for (text, v), h in zip(cells, head))
        rows.append(f'<tr{" class=win" if p.rank == 1 else ""}>{tds}</tr>')
    ths = "".join(f'<th class="{c}" data-sort="{s}">{esc(n)}</th>' for n, s, c in head)
    return (f'<div class="wide"><table class="sortable" id="top-plans"><thead><tr>{ths}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def _other_ranking(r: SearchResult, train: list[dict[str, float] | None] | None) -> str:
    """The top plans by the other objective (step time, or time to target) where it differs."""
    if not r.other_plans or [p.plan.short() for p in r.other_plans] == [p.plan.short() for p in r.plans]:
        return ""
    other = dataclasses.replace(r, plans=r.other_plans, objective=r.other_objective or "time")
    what = {"time": "step time", "time-to-target": "time to a target loss"}.get(r.other_objective or "", "")
    return (f"<h3>Ranked by {what} instead</h3><p>The same search ranked by {what}: the methods that sync "
            "less often or compress trade tokens (their token-efficiency factor) for time per step.</p>"
            + _top_table(other, None).replace('id="top-plans"', 'id="other-ranking"'))


def _pareto(r: SearchResult, usable: float) -> str:
    if not r.pareto:
        return ('<section id="pareto"><h2>Pareto front</h2><p class="mut">No feasible plan, so there is no '
                "front to draw.</p></section>")
    multi = len(r.clusters) > 1
    rows = "".join(
        f'<tr><td class="l plan">{_plan(p.plan.short())}</td>' + (f"<td>{p.plan.num_gpus:,}</td>" if multi else "")
        + f"<td>{fixed3(p.step_time_s)}</td><td>{p.peak_memory_gib:.1f}</td><td>{fixed3(p.usd_per_mtok)}</td></tr>"
        for p in r.pareto)
    head = ('<th class="l" data-sort="text">plan</th>' + ('<th data-sort="num">GPUs</th>' if multi else "")
            + '<th data-sort="num">step time (s)</th><th data-sort="num">peak GiB</th>'
              '<th data-sort="num">$ / M tokens</th>')
    return ('<section id="pareto"><h2>Pareto front: time, memory, dollars</h2>'
            f"<p>{len(r.pareto)} plans are not beaten on all three of step time, peak memory per GPU and dollars "
            f"per million tokens (grey: all {r.feasible:,} feasible plans; circles: the top plans by rank; "
            "star: the winner; hover for details).</p>"
            f'<div class="pair">{charts.pareto_plot(r, "memory", usable)}{charts.pareto_plot(r, "dollars")}</div>'
            f'<details><summary>the {len(r.pareto)} plans of the front</summary><table class="sortable" '
            f'id="front"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></details></section>')


def _breakdowns(r: SearchResult) -> str:
    if not r.plans:
        return ""
    return ('<section id="breakdown"><h2>Where the time and memory go</h2>'
            "<h3>Step time of the top plans</h3>" + charts.time_breakdown(r)
            + "<h3>Memory per GPU of the top plans</h3>" + charts.memory_breakdown(r) + "</section>")


def _simulation(r: SearchResult, sim: Any, summary: dict[str, Any] | None, error: str | None) -> str:
    head = '<section id="timeline"><h2>Simulated step of the winner</h2>'
    if r.best is None:
        return head + '<p class="mut">No plan fits, so there is nothing to simulate.</p></section>'
    if sim is None or summary is None:
        return head + f'<p class="mut">Not simulated: {esc(error or "no simulation")}.</p></section>'
    s = summary
    g = charts.gantt(sim)
    rows = "".join(
        f"<tr><td>{k['rank']}</td>"
        + "".join(f"<td>{fixed3(k['busy_s'][st])}</td>" for st in STREAMS)
        + f"<td>{fixed3(k['pipeline_wait_s'])}</td><td>{k['peak_memory_gib']:.1f}</td></tr>"
        for k in s["ranks"][:64])
    more = f"<p class='mut'>first 64 of {len(s['ranks'])} ranks</p>" if len(s["ranks"]) > 64 else ""
    usable = r.best.report.usable_memory_gib
    smp = s.get("sampled")
    if smp:  # a length distribution: sampled steps (sim.simulate)
        text = (f"<p>Discrete-event simulation of {smp['batches']} sampled steps of {_plan(r.best.plan.short())} "
                f"(lengths {esc(smp['lengths'])}, {esc(smp['packing'])}; seed {smp['seed']}): mean "
                f"<b>{fixed3(s['step_time_s'])} s</b> (p50 {fixed3(smp['p50_step_s'])} s, p90 "
                f"{fixed3(smp['p90_step_s'])} s; {fixed3(smp['imbalance_s'])} s lost to imbalance) against the "
                f"cost model's expected step of {fixed3(s['analytic_step_time_s'])} s "
                f"({s['sim_vs_analytic_pct']:+.2f}%). The chart shows {esc(smp['timeline'])} "
                f"({fixed3(smp['timeline_step_s'])} s); move the mouse over it for the time.</p>")
        mem = charts.sim_memory(sim, usable) if any(len(m) > 1 for m in sim.memory) else ""
    else:
        text = (f"<p>Discrete-event simulation of one step of {_plan(r.best.plan.short())} "
                f"(schedule {esc(s['schedule'])}, {s['microbatches']} micro-batches per pipeline"
                + (f", {s['virtual_stages']} virtual stages" if s.get("virtual_stages", 1) > 1 else "")
                + f"): <b>{fixed3(s['step_time_s'])} s</b> against the analytical estimate of "
                f"{fixed3(s['analytic_step_time_s'])} s ({s['sim_vs_analytic_pct']:+.2f}%); pipeline ranks wait for "
                f"inputs {100 * s['bubble_fraction']:.1f}% of the step. Each pipeline rank has four lanes: compute, "
                "TP/CP/EP communication, data-parallel/FSDP communication and pipeline sends. Move the mouse over "
                "the chart for the time.</p>")
        mem = charts.sim_memory(sim, usable)
    return (head + text + g + ("<h3>Memory per GPU during the step</h3>" + mem if mem else "")
            + '<details><summary>busy seconds per rank and stream</summary><table class="sortable" id="ranks">'
              '<thead><tr><th data-sort="num">rank</th>'
            + "".join(f'<th data-sort="num">{esc(STREAM_NAMES[st])}</th>' for st in STREAMS)
            + '<th data-sort="num">waiting</th><th data-sort="num">peak GiB</th></tr></thead>'
            + f"<tbody>{rows}</tbody></table>{more}</details></section>")


def _explanation(r: SearchResult) -> str:
    lines = explain(r)
    rej = rejection_lines(r)
    why = lines[:len(lines) - len(rej)]
    heading = "Why this plan" if r.best is not None else "Why no plan fits"
    out = [f'<section id="explanation"><h2>{heading}</h2>']
    if why:
        out.append("<ul>" + "".join(f"<li>{esc(x)}</li>" for x in why) + "</ul>")
    if r.best is None:
        out.append("<p>Every candidate breaks a rule or does not fit in memory; what would make the problem "
                   'feasible is listed <a href="#verdict">at the top</a>.</p>')
    if len(r.clusters) > 1 and r.per_cluster:
        rows = "".join(
            f"<tr><td>{pc.num_gpus:,}</td><td>{pc.considered:,}</td><td>{pc.feasible:,}</td>"
            + (f"<td>{fixed3(pc.best_step_time_s)}</td><td>{fixed3(pc.best_usd_per_mtok)}</td>"
               if pc.best_step_time_s is not None else '<td colspan="2" class="l">no feasible plan</td>') + "</tr>"
            for pc in r.per_cluster)
        out.append('<h3>Best per cluster size</h3><table id="per-cluster"><thead><tr><th>GPUs</th><th>plans</th>'
                   "<th>feasible</th><th>best step (s)</th><th>$ / M tokens</th></tr></thead>"
                   f"<tbody>{rows}</tbody></table>")
    out.append(f"<h3>Candidates by outcome</h3><p>{esc(rej[0].rstrip(':'))}; each is counted once, under the first "
               "rule it breaks (hover a bar for an example).</p>" + charts.rejection_chart(r))
    if r.reject_examples:
        rows = "".join(f'<tr><td class="l">{esc(n)}</td><td>{r.rejected.get(n, 0):,}</td>'
                       f'<td class="l"><code>{esc(ex)}</code></td></tr>'
                       for n, ex in sorted(r.reject_examples.items(), key=lambda kv: (-r.rejected.get(kv[0], 0),
                                                                                       kv[0])))
        out.append('<table id="reject-examples"><thead><tr><th class="l">reason</th><th>count</th>'
                   f'<th class="l">example (what is wrong and how to fix it)</th></tr></thead><tbody>{rows}'
                   "</tbody></table>")
    if r.notes:
        out.append("<h3>Notes</h3><ul>" + "".join(f"<li>{esc(x)}</li>" for x in r.notes) + "</ul>")
    out.append("</section>")
    return "".join(out)


def lengths_note(work: Any) -> str:
    """' (lengths 2048:0.6,...)' for a distribution of several lengths, else ''."""
    d = work.lengths
    return "" if d is None or len(d.lengths) == 1 else f" (lengths {d.text()})"


def render(result: SearchResult, *, usable_gib: float, sim: Any = None, sim_summary: dict[str, Any] | None = None,
           sim_error: str | None = None, train: list[dict[str, float] | None] | None = None,
           command: str | None = None) -> str:
    """The whole page. A pure function of its arguments (the search time is the only
    run-dependent number; it sits in a ``span.timing``)."""
    r = result
    c = r.clusters[-1] if len(r.clusters) == 1 else None
    where = (f"{c.num_gpus:,} x {c.gpu.name}" if c is not None else
             f"{r.clusters[0].num_gpus:,}-{r.clusters[-1].num_gpus:,} x {r.clusters[0].gpu.name}")
    heading = f"{r.model.name} on {where}"
    doc = r.to_json(timing=False) | {"explanation": explain(r), "simulation": sim_summary, "train": train}
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (
        ("problem", "problem"), ("top-plans-section", "top plans"), ("pareto", "Pareto front"),
        ("breakdown", "breakdowns"), ("timeline", "timeline"), ("explanation", "why")))
    ranked_by = {"time": "step time", "cost": "dollars per million tokens",
                 "time-to-target": "time to a target loss (step time x the token-efficiency factor)"}
    top = ('<section id="top-plans-section"><h2>Top plans</h2>'
           + (f"<p>The {len(r.plans)} best feasible plans, ranked by "
              + ranked_by.get(r.objective, r.objective)
              + " (click a column to sort).</p>" + _top_table(r, train) if r.plans
              else '<p class="mut">None: no candidate plan satisfies the constraints and fits in memory.</p>')
           + _other_ranking(r, train) + "</section>")
    return "".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f"<title>meshplan report: {esc(heading)}</title>",
        f"<script>{JS_GUARD}</script><style>{CSS}</style></head><body><main>",
        f"<h1>meshplan report: {esc(heading)}</h1>",
        f'<p class="mut">{esc(workload_text(r.work))}{esc(lengths_note(r.work))}; '
        f"{r.considered:,} plans searched, {r.feasible:,} feasible</p><nav>{nav}</nav>",
        _verdict(r, train), _problem(r, command), top, _pareto(r, usable_gib), _breakdowns(r),
        _simulation(r, sim, sim_summary, sim_error), _explanation(r),
        f"<footer>meshplan {esc(__version__)}: cost model estimates, simulated timeline from the same "
        "durations. This page is self-contained (no network); the data behind it is in the "
        "<code>meshplan-data</code> JSON block.</footer></main>",
        json_script(doc), f"<script>{JS_MAIN}</script></body></html>\n"])
