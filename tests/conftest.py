"""Test-suite set-up shared by the notebook runner and the pytest files.

* No hub, ever: `HF_HUB_OFFLINE=1` and the hub download functions are patched to raise, so a loader that tried the
  network would fail loudly instead of silently fetching.
* Tokenizer and projection caches live under the project's `.cache/` unless `XTOKEN_DP_CACHE` says otherwise.
* Property tests (hypothesis) draw the same examples on every run, so that a suite that passed passes again; set
  `XTOKEN_DP_HYPOTHESIS_RANDOM=1` (and `XTOKEN_DP_HYPOTHESIS_EXAMPLES=N` for more examples) to explore new ones.
  No example database is written.
* One local Ray per test session (`ray_session`), started by the first test that asks for it and shut down at the end,
  so tests in different files share it instead of paying its start-up each.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("XTOKEN_DP_CACHE", str(ROOT / ".cache" / "xtoken_dp"))

import pytest
from hypothesis import settings

settings.register_profile("xtoken_dp", derandomize=os.environ.get("XTOKEN_DP_HYPOTHESIS_RANDOM") != "1", database=None)
settings.load_profile("xtoken_dp")


def _refuse_hub(*args, **kwargs):
    raise RuntimeError("xtoken_dp tests never download from a model hub")


@pytest.fixture(autouse=True, scope="session")
def _no_hub_downloads():
    "Patch the hub's download entry points so that any attempt fails the test that made it."
    patched = []
    try:
        import huggingface_hub
        for name in ("hf_hub_download", "snapshot_download"):
            if hasattr(huggingface_hub, name):
                patched.append((huggingface_hub, name, getattr(huggingface_hub, name)))
                setattr(huggingface_hub, name, _refuse_hub)
        import huggingface_hub.file_download as fd
        if hasattr(fd, "hf_hub_download"):
            patched.append((fd, "hf_hub_download", fd.hf_hub_download))
            fd.hf_hub_download = _refuse_hub
    except ImportError:
        pass
    yield
    for mod, name, orig in patched: setattr(mod, name, orig)


@pytest.fixture(scope="session")
def ray_session():
    "A local Ray for the whole test session (the first test that needs it starts it; it stops when the session ends)."
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tq_plane(ray_session):
    "One TransferQueue on the session's Ray for every test file (a second controller on the same Ray is refused); reads wait 0.4 s."
    pytest.importorskip("transfer_queue")
    from xtoken_dp.dataplane import TransferQueueDataPlane
    plane = TransferQueueDataPlane(bootstrap=True, timeout_s=0.4)
    yield plane
    plane.close()
    left = [a for a in ray_session.util.list_named_actors(all_namespaces=True) if a.get("namespace") == "transfer_queue"]
    assert not left, f"TransferQueue services still running after close(): {left}"
