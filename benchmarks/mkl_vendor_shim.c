/* The MKL inside torch's CPU wheels picks its fast small-matrix code paths only when it
 * believes the CPU is Intel's. Preloaded, this answers "yes" on any x86 CPU (the code paths
 * still check the instruction sets the CPU has). For measurements only (benchmarks/README.md,
 * "MKL on AMD hosts"); gspo itself does not use it.
 *
 *   gcc -shared -fPIC -o /tmp/libmkl_vendor_shim.so benchmarks/mkl_vendor_shim.c
 *   LD_PRELOAD=/tmp/libmkl_vendor_shim.so .venv-bench/bin/python benchmarks/vs_trl.py ...
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
