"""What a compiled program costs without running it.

``hardware`` holds the peak rates of the GPU targets (datasheet figures, with their sources) and
the launch constants; ``hlo`` parses XLA's optimized HLO text into instructions with shapes;
``thunks`` parses the thunk sequence XLA:GPU dumps (what the runtime launches, and which
kernels run inside CUDA graphs); ``estimate`` prices every kernel of a program from its FLOPs
and bytes and walks the thunk tree (loops by their trip counts, conditionals by the branch
asked for) to an estimated time; ``workload`` gives what the compiled program cannot say: the
useful FLOPs of a train step, the trip counts of the attention's data-dependent tile loops
and the keys a Pallas attention kernel visits, and a decode step's memory floor.
"""
