"""The real tools' parsers, loaded once per session; a test that needs a missing tool is skipped
with the install command, or fails when MESHPLAN_REQUIRE_EXPORT_TOOLS=1."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import warnings
from types import ModuleType, SimpleNamespace

import pytest

INSTALL = "bash scripts/install_export_tools.sh"
REQUIRED = os.environ.get("MESHPLAN_REQUIRE_EXPORT_TOOLS") == "1"


def _missing(tool: str, err: BaseException) -> None:
    msg = f"{tool} is not installed ({type(err).__name__}: {err}); install it with `{INSTALL}`"
    if REQUIRED:
        pytest.fail(msg + " [MESHPLAN_REQUIRE_EXPORT_TOOLS=1]", pytrace=False)
    pytest.skip(msg)


def _import_torchtitan_config() -> ModuleType:
    """torchtitan.config (JobConfig, ConfigManager). torchtitan/__init__.py registers the float8/MX
    model converters, whose MoE kernels import triton (a GPU compiler the CPU torch build lacks); the
    config package needs none of that, so without triton the package body is skipped and only
    torchtitan.config (and what it imports) runs."""
    try:
        return importlib.import_module("torchtitan.config")
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None
    sys.modules["torchtitan"] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
    return importlib.import_module("torchtitan.config")


@pytest.fixture(scope="session")
def torchtitan() -> SimpleNamespace:
    try:
        import tyro  # noqa: F401
        config = _import_torchtitan_config()
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as e:
        _missing("torchtitan", e)
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    root = os.path.dirname(importlib.util.find_spec("torchtitan").origin)  # type: ignore[union-attr]
    from importlib.metadata import version
    return SimpleNamespace(config=config, ParallelDims=ParallelDims, root=root, version=version("torchtitan"))


@pytest.fixture(scope="session")
def megatron() -> SimpleNamespace:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
            from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
            from megatron.core.optimizer.optimizer_config import OptimizerConfig
            from megatron.core.transformer.enums import AttnBackend
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
            from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        _missing("megatron-core", e)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from importlib.metadata import version
    return SimpleNamespace(TransformerConfig=TransformerConfig, DDPConfig=DistributedDataParallelConfig,
                           OptimizerConfig=OptimizerConfig, AttnBackend=AttnBackend,
                           Layout=PipelineParallelLayerLayout, Calculator=ConstantNumMicroBatchesCalculator,
                           version=version("megatron-core"))


@pytest.fixture(scope="session")
def deepspeed() -> SimpleNamespace:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.module_inject.auto_ep_config import AutoEPConfig, validate_autoep_config
            from deepspeed.runtime import config as ds_config
    except ImportError as e:
        _missing("deepspeed", e)
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from importlib.metadata import version
    return SimpleNamespace(config=ds_config, AutoEPConfig=AutoEPConfig, validate_autoep=validate_autoep_config,
                           version=version("deepspeed"))
