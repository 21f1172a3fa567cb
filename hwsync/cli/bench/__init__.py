"""`hwsync bench ...`: benchmarks that print a table (or --json), each against references measured in the same run.

transfer.py (process to process: hwsync vs the stop-and-wait baseline of stop_and_wait.py vs
memory copy bandwidth), vllm.py (into a real vLLM engine), broadcast.py (the disaggregated path).
"""
