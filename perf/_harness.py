"""The one harness of the ``perf/`` scripts: command line, device, timing, floors, providers,
NVTX, results (CSV, plot, table) and the claims the experiments check.

A benchmark (``perf/bench_<op>.py``) describes only its cases: for each shape, the inputs, the
providers that compute the op and the floor, the bytes or flops the op cannot avoid. It hands
them to :func:`run_benchmark`, which times every provider on the same inputs, divides the floor
by the device's measured bandwidth or matrix throughput, prints one table, and writes one CSV and
one plot through :func:`write_results` and :func:`save_plot`, the writers every script uses.

Providers, per case (the ones a case declares):

* ``triton``: the Triton launcher of the kernel alone (on a CUDA device with Triton);
* ``reference``: the plain-PyTorch reference of the op (everywhere else);
* ``op/<backend>``: the public op, ``tritonopt.ops.<op>``, run under
  ``tritonopt.use_backend(<backend>)``, argument checks and dispatch included, as users call it;
* ``torch``: the fastest eager-PyTorch composite of the same math, the baseline of the speed-ups;
* ``floor``: the floor's time, a lower bound on any provider's.

The harness is split by concern (``_device``, ``_cli``, ``_timing``, ``_bench_cases``,
``_records``, ``_claims``); this module gathers their names, so a script needs one import.

Nothing here queries CUDA at import time, and matplotlib is imported only to plot, so this
module imports on any machine.
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (tests patch harness.importlib.util.find_spec)

from perf._device import (  # noqa: F401
    CPU_PLOT_NOTE,
    ENVIRONMENT_COLUMNS,
    LOCAL_RESULTS_DIR,
    NO_CUDA_MESSAGE,
    PERF_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    announce_primary,
    cpu_model,
    cuda_available,
    default_device,
    device_label,
    device_name,
    device_results_dir,
    entries_per_block,
    output_dir,
    primary_backend,
    training_step_device,
)
from perf._cli import (  # noqa: F401
    bench_parser,
    fraction,
    nvtx_enabled,
    positive_int,
    script_parser,
    with_range,
)
from perf._timing import (  # noqa: F401
    Timing,
    Yardsticks,
    measure_bandwidth_gbps,
    measure_matmul_tflops,
    time_ms,
)
from perf._bench_cases import (  # noqa: F401
    BenchContext,
    Case,
    Plot,
    measure_case,
    run_benchmark,
    summary_table,
)
from perf._records import (  # noqa: F401
    environment_fields,
    format_table,
    format_value,
    git_sha,
    plot_series,
    progress,
    pyplot,
    save_plot,
    triton_version,
    write_results,
)
from perf._claims import (  # noqa: F401
    Claim,
    report_claims,
)
