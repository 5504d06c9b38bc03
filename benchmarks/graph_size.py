"""Graph build time, node count and peak allocator memory against N, unrolled vs loop mode.

    python benchmarks/graph_size.py [--problems blobs mlp] [--steps 1 10 100 1000]
"""

import argparse
import os

from multistep.tools import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--problems", nargs="+", choices=bench.PROBLEMS, default=list(bench.PROBLEMS))
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 10, 100, 1000])
    parser.add_argument("--cpu", type=int, default=0)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    costs = [bench.graph_costs(p, mode, n) for p in args.problems
             for mode in ("unrolled", "while_loop") for n in args.steps]
    print(bench.graph_table(costs))
