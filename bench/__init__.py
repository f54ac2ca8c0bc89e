"""The benchmark: the bundle against raw `AsyncLLM` and vLLM's own server (`python -m bench`).

Modules, one job each: `workload` (what is sent), `loadgen` (one level: send, time, summarise),
`requesters` (one request over HTTP or in-process), `client_processes` (a level split over
client processes), `levels` (repeats, medians, CPU per token), `servers` (servers as child
processes), `targets` (raw and HTTP targets), `suite` (the whole run and its JSON), `report` and
`plot` (its table and figure). `gpu.sh` runs it on a lent GPU; results are in `results*/`.
"""
