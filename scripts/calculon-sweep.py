#!/usr/bin/env python3
"""Calculon (github.com/calculon-ai/calculon) over the executions that match
tests/bench/sweep-gpt3-175b.yaml, one after another on one thread, timed as Calculon's own
search loops (llm-all-executions, llm-optimal-execution) run them: per execution
Llm(app, logger), compile(system, execution), run(system), the statistics.

    calculon-sweep.py CALCULON_DIR [--logger shipped|quiet] [--json]

GPT-3 175B, TP 8 x PP 8 x DP 1 (64 processors), pipeline interleaving 3, batch 64, float16,
and per execution one value of each axis of the trainsim file:
    cluster.gpu                    a100-80gb, h100-80gb -> systems/a100_80g.json, h100_80g_nvl8.json
    training.micro_batch_size      1, 2, 4, 8           -> microbatch_size
    activation_recompute           none, selective, full -> none, attn_only, full
    parallelism.sequence_parallel  false, true          -> tensor_par_comm_type ar, rs_ag
    cluster.compute_efficiency     0.40 .. 0.70 (7)     -> the matrix unit's tflops x efficiency / 0.6
    inter_node.bandwidth_gbps      25, 50               -> the second network's bandwidth
    cluster.hbm_bandwidth_gbps     1600, 2039, 3350     -> mem1 GBps
2,016 executions. The 84 systems are built before the clock starts (Calculon's own loops
build theirs once, before theirs). An execution that raises Llm.Error in compile() is
rejected before evaluation; one that raises in run() (out of memory: Calculon checks
memory after computing the step) has been evaluated, as trainsim's out_of_memory rows are.

--logger shipped: logging.Logger('sub'), as Calculon's loops create it (level NOTSET, so
every logger.debug call in the model builds its record); quiet: the same logger at level
WARNING (the debug messages' f-strings are still formatted, their records are not).
"""
import argparse
import copy
import json
import logging
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("calculon", help="a checkout of github.com/calculon-ai/calculon")
    ap.add_argument("--logger", choices=["shipped", "quiet"], default="quiet")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    sys.path.insert(0, args.calculon)
    import calculon  # noqa: E402
    from calculon import System  # noqa: E402
    from calculon.llm import Llm  # noqa: E402

    def read(path):
        return calculon.io.read_json_file(os.path.join(args.calculon, path))

    app = Llm.Application(read("models/gpt3-175B.json"))
    gpus = [("a100-80gb", read("systems/a100_80g.json")), ("h100-80gb", read("systems/h100_80g_nvl8.json"))]
    efficiencies = [0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7]
    inter_node = [25, 50]
    hbm = [1600, 2039, 3350]
    systems = {}
    for name, base in gpus:
        for e in efficiencies:
            for bw in inter_node:
                for gbps in hbm:
                    s = copy.deepcopy(base)
                    s["matrix"]["float16"]["tflops"] = base["matrix"]["float16"]["tflops"] * e / 0.6
                    s["networks"][1]["bandwidth"] = bw
                    s["mem1"]["GBps"] = gbps
                    systems[(name, e, bw, gbps)] = System(s)
    executions = []
    for name, _ in gpus:
        for mbs in [1, 2, 4, 8]:
            for recompute in ["none", "attn_only", "full"]:
                for comm in ["ar", "rs_ag"]:
                    for e in efficiencies:
                        for bw in inter_node:
                            for gbps in hbm:
                                exe = Llm.Execution(
                                    64, 8, 8, 1, 0, 1, 0, 64, mbs, "float16", True, "multihead", recompute, 3,
                                    False, comm, "none", False, False, False, False, False, True)
                                executions.append((systems[(name, e, bw, gbps)], exe))

    make_logger = (lambda: logging.Logger("sub")) if args.logger == "shipped" else (
        lambda: logging.Logger("sub", logging.WARNING))
    evaluated = rejected = out_of_memory = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for syst, exe in executions:
        model = Llm(app, make_logger())
        try:
            model.compile(syst, exe)
        except Llm.Error:
            rejected += 1
            continue
        try:
            model.run(syst)
            model.get_stats_values()
        except Llm.Error:
            out_of_memory += 1
        evaluated += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    out = {"executions": len(executions), "evaluated": evaluated, "rejected": rejected,
           "out_of_memory": out_of_memory, "cpu_s": cpu, "wall_s": wall,
           "evaluations_per_cpu_s": evaluated / cpu if cpu > 0 else 0.0, "logger": args.logger}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"calculon ({args.logger} logger): {len(executions)} executions: {evaluated} evaluated "
              f"({out_of_memory} out of memory), {rejected} rejected; {cpu:.2f} s CPU ({wall:.2f} s wall): "
              f"{out['evaluations_per_cpu_s']:.1f} evaluations per CPU-second")


if __name__ == "__main__":
    main()
