"""emm on a real Dask cluster (``distributed.LocalCluster``, worker processes, no mocks), on
emm's simulated GPU: the plugin sets every worker up, the metrics reach the scheduler, the
memory report gathers every worker, a restarted worker is set up again, and a worker that dies
mid-task leaves the rest of the cluster and its results alone."""

import json
import os
import time

import pytest

import emm

from conftest import DRIVER

distributed = pytest.importorskip(
    "distributed",
    reason="emm.dask's tests need distributed (ci/test installs it into .venv-test)",
)
import emm.dask  # noqa: E402  (needs distributed)

# The tasks the workers run: a module of their own, which the workers import (this one imports
# conftest, which makes a runtime of the test process's settings). It needs distributed too.
from dask_tasks import die, first_and_last, hold, make  # noqa: E402

MIB = 1 << 20


def local_cluster(workers, **more):
    """A LocalCluster of ``workers`` worker processes of one thread, no dashboards."""
    return distributed.LocalCluster(
        n_workers=workers,
        processes=True,
        threads_per_worker=1,
        worker_dashboard_address=None,
        **{"dashboard_address": None, **more},
    )


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    if DRIVER != "sim":
        pytest.skip("the workers run on emm's simulated GPU here; the GPU job runs its own")
    # Worker processes inherit the environment: the simulated driver, a small device.
    monkeypatch.setenv("EMM_PYTHON_DRIVER", "sim")
    monkeypatch.setenv("EMM_SIM_DEVICE_MEMORY", str(1 << 30))
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with local_cluster(2) as c, distributed.Client(c) as client:
            yield c, client


def emm_metrics(client):
    """The ``emm`` metric of every worker, as the scheduler last heard it."""
    return client.run_on_scheduler(
        lambda dask_scheduler: {
            a: ws.metrics.get("emm") for a, ws in dask_scheduler.workers.items()
        }
    )


def worker_after_retries(client):
    """The figures of the cluster's one worker once its out-of-memory retries reached the
    scheduler (it hears them at the worker's next heartbeat)."""
    (figures,) = wait_for(
        lambda: (m := emm_metrics(client)) and all(v and v["oom_retries"] > 0 for v in m.values()) and m,
        "the worker's out-of-memory retries at the scheduler",
    ).values()
    return figures


def wait_for(check, what, timeout=30):
    """Polls ``check()`` until it returns a true value; returns it."""
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not seen within {timeout} s")
        time.sleep(0.2)


def test_every_worker_is_set_up_reports_its_figures_and_is_in_the_report(cluster, tmp_path):
    c, client = cluster
    logs = tmp_path / "logs"
    client.register_plugin(
        emm.dask.EmmSetup(manager="pool", maximum="256MiB", log_directory=str(logs))
    )
    workers = sorted(client.scheduler_info()["workers"])
    assert len(workers) == 2
    sizes = {workers[0]: 8 * MIB, workers[1]: 24 * MIB}
    for w, n in sizes.items():
        assert client.submit(hold, n, workers=[w], pure=False).result() == n
    # Each worker's figures reach the scheduler with its heartbeats.
    seen = wait_for(
        lambda: (m := emm_metrics(client))
        and all(m.get(w) and m[w]["live_bytes"] == n for w, n in sizes.items())
        and m,
        "each worker's live bytes in the scheduler's metrics",
    )
    # Dask's own GPU memory panel reads emm's figures under RMM's names.
    panel = client.run_on_scheduler(
        lambda dask_scheduler: {
            a: ws.metrics.get("rmm") for a, ws in dask_scheduler.workers.items()
        }
    )
    for w, n in sizes.items():
        assert panel[w]["rmm-used"] == n, panel
        assert panel[w]["rmm-total"] == seen[w]["held_bytes"] >= n, (panel, seen)
    for w, n in sizes.items():
        figures = seen[w]
        assert figures["manager"] == "log(limit(stats(pool)))", figures
        assert figures["held_bytes"] >= n and figures["peak_live_bytes"] >= n, figures
        assert figures["ooms"] == 0, figures
    # The maximum is the limit adaptor's: past it, the task fails with emm's error.
    too_much = client.submit(hold, 300 * MIB, workers=[workers[0]], pure=False)
    with pytest.raises(Exception, match="limit"):
        too_much.result()
    # One log per worker, named after it.
    emm_logs = sorted(p.name for p in logs.iterdir())
    assert len(emm_logs) == 2 and all(n.startswith("emm-") for n in emm_logs), emm_logs
    report = emm.dask.memory_report(client)
    assert [r["worker"] for r in report.rows] == workers
    assert {r["worker"]: r["largest_live_block"] for r in report.rows} == sizes
    table = report.table()
    assert all(w in table for w in workers), table
    page = tmp_path / "memory.html"
    report.save_html(page)
    text = page.read_text()
    assert text.count("<h2>") == 2 and "class=segment" in text, text[:500]


def test_a_restarted_worker_is_set_up_again(cluster):
    c, client = cluster
    client.register_plugin(emm.dask.EmmSetup(manager="vmm-pool"))
    w = sorted(client.scheduler_info()["workers"])[0]
    client.submit(hold, 4 * MIB, workers=[w], pure=False).result()
    client.restart()
    # New processes: the plugin ran again in each, nothing is held.
    seen = wait_for(
        lambda: (m := emm_metrics(client))
        and len(m) == 2
        and all(f and f["manager"] == "stats(vmm-pool)" and f["live_bytes"] == 0 for f in m.values())
        and m,
        "both restarted workers set up under vmm-pool",
    )
    assert len(seen) == 2


def test_a_worker_that_dies_mid_task_leaves_the_cluster_and_its_results(cluster):
    c, client = cluster
    client.register_plugin(emm.dask.EmmSetup(manager="pool"))
    a, b = sorted(client.scheduler_info()["workers"])
    kept = client.submit(hold, 16 * MIB, workers=[b], pure=False)
    assert kept.result() == 16 * MIB

    doomed = client.submit(die, 8 * MIB, workers=[a], pure=False)
    with pytest.raises(distributed.KilledWorker):
        doomed.result(timeout=60)
    # The other worker's result and memory are untouched; the dead one is replaced and set up.
    assert kept.result() == 16 * MIB
    seen = wait_for(
        lambda: (m := emm_metrics(client))
        and len(m) == 2
        and all(f and f["manager"] == "stats(pool)" for f in m.values())
        and m,
        "the replacement worker set up",
    )
    assert 16 * MIB in [f["live_bytes"] for f in seen.values()], seen


def test_the_preload_sets_a_worker_up_from_its_environment(monkeypatch):
    if DRIVER != "sim":
        pytest.skip("the workers run on emm's simulated GPU here; the GPU job runs its own")
    monkeypatch.setenv("EMM_PYTHON_DRIVER", "sim")
    monkeypatch.setenv("EMM_MEMORY_MANAGER", "pool")
    monkeypatch.setenv("EMM_DASK_MAXIMUM", "64MiB")
    monkeypatch.setenv("EMM_DASK_FRAMEWORKS", "torch")
    with local_cluster(1, preload=["emm.dask"]) as c, distributed.Client(c) as client:
        client.submit(hold, MIB, pure=False).result()
        seen = wait_for(
            lambda: (m := emm_metrics(client))
            and all(f and f["live_bytes"] == MIB for f in m.values())
            and m,
            "the preloaded worker's figures",
        )
        (figures,) = seen.values()
        assert figures["manager"] == "limit(stats(pool))", figures
        assert figures["live_bytes"] == MIB, figures


@pytest.mark.parametrize("bound", ["device", "maximum"])
@pytest.mark.parametrize("spill", [True, False])
def test_results_past_the_device_spill_or_fail_with_emms_report(
    monkeypatch, tmp_path, spill, bound
):
    """Twelve results of 40 MiB on a 256 MiB device, or under a worker maximum of 256 MiB on a
    larger one: with spilling, the out-of-memory callback has the worker pickle its oldest
    results to disk, the computation completes and every result comes back with its bytes;
    without, the task that finds no room fails with emm's error (the out-of-memory report, or
    the limit's), and the worker goes on."""
    if DRIVER != "sim":
        pytest.skip("the workers run on emm's simulated GPU here; the GPU job runs its own")
    monkeypatch.setenv("EMM_PYTHON_DRIVER", "sim")
    device = 256 * MIB if bound == "device" else 1024 * MIB
    monkeypatch.setenv("EMM_SIM_DEVICE_MEMORY", str(device))
    maximum = "256MiB" if bound == "maximum" else None
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), local_cluster(
        1, memory_limit="4GiB", local_directory=str(tmp_path)
    ) as c, distributed.Client(c) as client:
        client.register_plugin(emm.dask.EmmSetup(manager="default", maximum=maximum, spill=spill))
        futures = [client.submit(make, 40 * MIB, k + 1, pure=False) for k in range(12)]
        if not spill:
            refused = (
                pytest.raises(emm.OutOfMemoryError, match="out of memory on device 0")
                if bound == "device"
                else pytest.raises(emm.EmmError, match="over the limit")
            )
            with refused:
                client.gather(futures)
            # The worker is alive and serves what fits.
            assert client.submit(first_and_last, futures[0]).result() == (1, 1)
            return
        distributed.wait(futures)
        back = [client.submit(first_and_last, f, pure=False).result() for f in futures]
        assert back == [(k + 1, k + 1) for k in range(12)], back
        f = worker_after_retries(client)
        assert f["ooms"] == 0, f



def test_the_dashboard_page_shows_every_workers_figures_in_a_browser(monkeypatch, tmp_path):
    """The scheduler's ``/emm`` page, loaded in headless Chromium (a real browser, Debian's
    package: ``.ci/run`` installs it), lists every worker with the figures its metrics sent,
    the live bytes a task holds among them. Where Chromium is missing the test says so and
    skips, unless ``EMM_REQUIRE_BROWSER=1`` (CI) makes that a failure."""
    import shutil
    import subprocess
    import urllib.request

    if DRIVER != "sim":
        pytest.skip("the workers run on emm's simulated GPU here; the GPU job runs its own")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("EMM_REQUIRE_BROWSER") == "1":
            pytest.fail("EMM_REQUIRE_BROWSER=1 and no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH: install Debian's chromium to run the dashboard's check")
    monkeypatch.setenv("EMM_PYTHON_DRIVER", "sim")
    emm.dask.enable_dashboard_page()
    with local_cluster(2, dashboard_address="127.0.0.1:0") as c, distributed.Client(c) as client:
        client.register_plugin(emm.dask.EmmSetup(manager="pool"))
        workers = sorted(client.scheduler_info()["workers"])
        client.submit(hold, 12 * MIB, workers=[workers[0]], pure=False).result()
        wait_for(
            lambda: (f := emm_metrics(client).get(workers[0])) and f["live_bytes"] == 12 * MIB,
            "the worker's live bytes at the scheduler",
        )
        port = c.scheduler.http_server.port
        url = f"http://127.0.0.1:{port}/emm"
        figures = json.load(urllib.request.urlopen(url + "/figures.json"))
        assert figures[workers[0]]["live_bytes"] == 12 * MIB, figures
        page = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert page.returncode == 0, page.stderr[-2000:]
        dom = page.stdout
        assert "emm-workers" in dom, dom[:2000]
        for w in workers:
            assert w in dom, dom[:2000]
        assert f"<td class=\"live_bytes\">{12 * MIB}</td>" in dom, dom[:3000]
        assert "stats(pool)" in dom, dom[:2000]


def test_the_rmm_panel_metric_adds_emm_to_rmms_figures_once():
    """Where RMM's own ``rmm`` metric is there too (RMM installed on the worker), the panel gets
    both memories added; setting the worker up again does not add emm's twice."""
    import asyncio

    ctx = emm.context(0)
    held = ctx.memalloc(4 * MIB)
    mine = emm.dask.rmm_panel_figures()
    assert mine["rmm-used"] >= 4 * MIB or ctx.pool_stats()["device"] is None, mine
    assert mine["rmm-total"] >= mine["rmm-used"], mine

    async def rmm_own(worker):
        return {"rmm-used": 100, "rmm-total": 1000}

    once = emm.dask.rmm_panel_metric(rmm_own)
    twice = emm.dask.rmm_panel_metric(once)
    for metric in (once, twice):
        got = asyncio.run(metric(None))
        assert got == {"rmm-used": mine["rmm-used"] + 100, "rmm-total": mine["rmm-total"] + 1000}
    alone = asyncio.run(emm.dask.rmm_panel_metric(None)(None))
    assert alone == mine
    del held
