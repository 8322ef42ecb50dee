"""The report page of a search over several GPU pools (search.search's pools stage): what each pool does, its
utilisation, the time lost to imbalance, the plans of every kind, and the simulated timeline
with every rank on its own pool's hardware (sim.pools). Self-contained HTML, like report.page."""
from __future__ import annotations

from typing import Any

from meshplan import __version__
from meshplan.report.page import CSS, JS_GUARD, JS_MAIN, json_script, lengths_note
from meshplan.spec.lengths import workload_text
from meshplan.svg import esc


def _util_bars(parts: list[Any], step: float) -> str:
    """One bar per pool: its own work, the wait for the slowest pool, the cross-pool exchange."""
    w, row, left = 760, 34, 150
    h = 40 + row * len(parts)
    scale = (w - left - 80) / max(step, 1e-12)
    out = [f'<svg class="plot" data-plot="pools" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
           'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="per-pool utilisation">']
    colours = (("work", "#2f5fa7"), ("waits for the slowest pool", "#d9a400"), ("across pools", "#7a4fa0"))
    x = left
    for name, c in colours:
        out.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{c}"/>'
                   f'<text x="{x + 14}" y="15" font-size="11">{esc(name)}</text>')
        x += 40 + 7 * len(name)
    for i, p in enumerate(parts):
        y = 30 + i * row
        own = max(0.0, step - p.idle_s - p.cross_s)
        segs = ((own, "#2f5fa7"), (p.idle_s, "#d9a400"), (p.cross_s, "#7a4fa0"))
        x0 = float(left)
        out.append(f'<text x="{left - 8}" y="{y + 15}" font-size="12" text-anchor="end">{esc(p.name)} '
                   f'({p.gpus})</text>')
        for v, c in segs:
            if v <= 0:
                continue
            out.append(f'<rect data-mark="1" x="{x0:.1f}" y="{y}" width="{v * scale:.1f}" height="20" fill="{c}">'
                       f"<title>{esc(p.name)}: {v:.3f} s</title></rect>")
            x0 += v * scale
        out.append(f'<text x="{x0 + 4:.1f}" y="{y + 15}" font-size="11">{100 * p.busy_fraction:.0f}% busy</text>')
    out.append("</svg>")
    return "".join(out)


class _Bar:
    def __init__(self, p: Any, cross: float) -> None:
        self.name, self.gpus, self.idle_s, self.busy_fraction, self.cross_s = \
            p.name, p.gpus, p.idle_s, p.busy_fraction, cross


def render_pooled(res: Any, sim: Any = None, summary: dict[str, Any] | None = None, command: str | None = None) -> str:
    """The whole page for the SearchResult ``res`` of a cluster of several pools and the simulation
    of its best plan (sim.simulate: its timeline ``sim`` and ``summary``)."""
    from meshplan.sim.output import gantt, sim_memory
    pc, work, best = res.clusters[0], res.work, res.best_pooled
    heading = f"{esc(str(res.model.name))} on {esc(pc.name)} ({esc(pc.describe())})"
    parts_html = ""
    if best is not None:
        rows = "".join(
            f"<tr><td class=l>{esc(p.name)}</td><td class=l>{esc(p.gpu)}</td><td>{p.gpus} / {p.gpus_total}</td>"
            f"<td class=l>{esc(p.role)}</td><td data-v='{p.step_s}'>{p.step_s:.3f}</td>"
            f"<td data-v='{p.idle_s}'>{p.idle_s:.3f}</td><td data-v='{p.busy_fraction}'>"
            f"{100 * p.busy_fraction:.0f}%</td><td>{p.peak_memory_gib:.1f} / {p.usable_memory_gib:.1f}</td></tr>"
            for p in best.parts)
        lost = best.imbalance_s
        parts_html = (
            '<section id="pools"><h2>Per-pool utilisation</h2><div class=wide>'
            "<table class=sortable><thead><tr><th class=l data-sort=str>pool</th><th class=l>GPU</th>"
            "<th>GPUs used</th><th class=l>role</th><th data-sort=num>own part (s)</th>"
            "<th data-sort=num>waits (s)</th><th data-sort=num>utilisation</th><th>memory GiB</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></div>"
            + _util_bars([_Bar(p, best.cross_pool_s) for p in best.parts], best.step_time_s)
            + f"<p><b>Time lost to imbalance:</b> {lost:.3f} s per step ({100 * lost / best.step_time_s:.1f}% of "
              f"the step, GPU-weighted): the pools that finish first wait for the slowest. "
              f"{lost * best.num_gpus * 1000 / 3600:.1f} GPU-hours per 1,000 steps. Across pools: "
              f"{best.cross_pool_s:.3f} s per step ({best.cross_pool_gb:.2f} GB per GPU).</p></section>")
    plans = "".join(
        f"<tr{' class=win' if i == 0 else ''}><td>{i + 1}</td><td data-v='{e.step_time_s}'>{e.step_time_s:.2f}</td>"
        f"<td>{e.num_gpus}</td><td data-v='{e.usd_per_m_tokens}'>{e.usd_per_m_tokens:.3f}</td>"
        f"<td data-v='{e.imbalance_s}'>{e.imbalance_s:.2f}</td><td class='l plan'><code>{esc(e.plan.short())}</code>"
        "</td></tr>" for i, e in enumerate(res.pooled_plans))
    kinds = "".join(
        f"<li><b>{esc(k)}</b>: " + (f"{e.step_time_s:.2f} s, <code>{esc(e.plan.short())}</code>" if e else
                                    "no plan fits with memory headroom") + "</li>"
        for k, e in [*[(f"{n} alone", v) for n, v in res.alone.items()], *res.best_by_kind.items()])
    timeline = ""
    if sim is not None and summary is not None:
        usable = min(p.usable_memory_gib for p in best.parts) if best else None
        used = best.plan.pools[0] if best is not None and best.plan.pools else ""
        labels = ", ".join(f"{p['pool']}: ranks {p['ranks'][0]}-{p['ranks'][-1]}" if len(p["ranks"]) > 1 else
                           f"{p['pool']}: rank {p['ranks'][0]}" for p in summary.get("pools", ())) \
            or f"{used}: every rank"  # a plan on one pool alone
        t, a = summary["step_time_s"], summary["analytic_step_time_s"]
        timeline = ('<section id="timeline"><h2>Simulated step</h2>'
                    f"<p>Simulated {t:.3f} s vs the cost model's {a:.3f} s "
                    f"({100 * (t / a - 1):+.2f}%). Rows by pool: {esc(labels)}. "
                    "Every rank runs at its own pool's speed (the durations come from the cost model per GPU "
                    "type)." + "".join(f" {esc(n[0].upper() + n[1:])}." for n in summary.get("notes", ())) + "</p>"
                    + gantt(sim)
                    + (sim_memory(sim, usable) if any(len(m) > 1 for m in sim.memory) else "")
                    + "</section>")
    doc = {"search": res.to_json(), "simulation": summary}
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (("pools", "per pool"), ("plans", "plans"),
                                                        ("timeline", "timeline"), ("explanation", "why")))
    verdict = ("<div class=verdict><div class=big>" + esc(res.explanation[0] if res.explanation else "") + "</div>"
               + (f"<p><code>{esc(best.plan.short())}</code></p>" if best else "") + "</div>")
    return "".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f"<title>meshplan report: {heading}</title>",
        f"<script>{JS_GUARD}</script><style>{CSS}</style></head><body><main>",
        f"<h1>meshplan report: {heading}</h1>",
        f'<p class="mut">{esc(workload_text(work))}{esc(lengths_note(work))}; {res.considered:,} plans '
        f"searched over {len(pc.pools)} pools" + (f"; <code>{esc(command)}</code>" if command else "")
        + f"</p><nav>{nav}</nav>", verdict, parts_html,
        f'<section id="plans"><h2>Plans</h2><ul>{kinds}</ul><div class=wide><table class=sortable><thead><tr><th>#</th>'
        "<th data-sort=num>step (s)</th><th>GPUs</th><th data-sort=num>$/M tokens</th>"
        f"<th data-sort=num>imbalance (s)</th><th class=l>plan</th></tr></thead><tbody>{plans}</tbody></table></div>"
        "</section>", timeline,
        '<section id="explanation"><h2>Why</h2><ul>'
        + "".join(f"<li>{esc(x.strip())}</li>" for x in res.explanation) + "</ul></section>",
        f"<footer>meshplan {esc(__version__)}: cost model estimates per pool, simulated timeline from the same "
        "durations. Self-contained (no network).</footer></main>",
        json_script(doc),
        f"<script>{JS_MAIN}</script></body></html>\n"])
