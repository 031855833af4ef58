"""Benchmarks, the demo and the papers' experiments of tritonopt (not part of the package).

Run each script from the repository root as a module, ``python -m perf.<name>`` (or as a
file, ``python perf/<name>.py``). ``--help`` lists its options; ``--smoke`` runs it small, in
seconds, writing under ``perf/results/local/smoke/`` (not committed).

* ``bench_<op>``: one op against its torch composite and its floor;
* ``bench_optimizer_step``: every optimizer's step against torch's SGD, Adam and Adagrad;
* ``autotune``: warms and records Triton's autotune cache for real model shapes;
* ``demo_digits``: the demo, eight optimizers on the digits MLP;
* ``efcp_experiment``, ``kfac_experiment``, ``kaisa_tradeoff``, ``fosi_experiment``,
  ``ssd_sgd_experiment``, ``dsp_experiment``, ``comm_hooks_experiment``: the papers' claims at
  CPU scale; each exits with status 1 when a claim it checks fails.

The modules whose names start with an underscore are not scripts. Shared by several:
``_harness`` (the facade over ``_cli``, ``_device``, ``_timing``, ``_bench_cases``, ``_records``
and ``_claims``: command line, timing, floors, providers, NVTX, results, claims), ``_ranks``
(gloo ranks in processes of their own), ``_digits`` (the digits task), ``_optimizers`` (the
optimizers as train steps), ``_models`` (ResNets), ``_stats`` (mean and standard error over seeds) and ``_as_module`` (the file
entry point).
One experiment's parts: ``_ssd_sgd_train``, ``_ssd_sgd_link`` and ``_ssd_sgd_report`` (the
SSD-SGD experiment's runs, link model and report); ``_dsp_setup``, ``_dsp_accuracy`` and
``_dsp_timing`` (the DSP experiment's task, accuracy sweep and timed modes).
"""
