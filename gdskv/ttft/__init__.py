"""The TTFT benchmark: TTFT and KV hit rate per round of a multi-turn workload, with the
engine's pool only, + a gdskv DRAM tier, + DRAM and SSD, + promotion (``gdskv bench-ttft``,
``benchmarks/bench_ttft.py``).

- :mod:`~gdskv.ttft.workload`: the configuration, the workload, the capacities of a run;
- :mod:`~gdskv.ttft.measure`: a round's figures, disk reads, the page-cache drop, the banner;
- :mod:`~gdskv.ttft.report`: the report, the acceptance check, the table, JSON and plots;
- :mod:`~gdskv.ttft.reference_engine`: the reference model, a random-weight Llama with a
  paged KV pool over :mod:`gdskv.engine` (also used by tests);
- :mod:`~gdskv.ttft.vllm_engine`: a real vLLM engine on a random-weight Llama, with the
  connector of :mod:`gdskv.connectors.vllm` (also used by the connector's tests);
- :mod:`~gdskv.ttft.run_reference`, :mod:`~gdskv.ttft.run_vllm`: the runners, one per engine,
  both on the workload, measure and report modules;
- :mod:`~gdskv.ttft.command`: the options, and the dispatch to a runner.

Imports go one way: command -> runners -> engines, workload, measure, report. Importing any
of these needs numpy and xxhash only; torch and transformers (the ``engine`` extra),
matplotlib and rich (the ``bench`` extra) and vLLM are imported when a run needs them.
"""
