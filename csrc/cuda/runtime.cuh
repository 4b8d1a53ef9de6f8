// The runtime kernels' host side (runtime.cu), for the call kinds that launch them: the
// device-side wait on a group counter, the counter reset and the post-communication reorder.
// The kernels stay in runtime.cu; the call kinds reach them only through these functions.
#pragma once
#include "flashoverlap_cuda.h"  // the runtime's API
#include <cuda_runtime.h>
#include <stdint.h>

namespace fo::runtime {

// `stream` waits until *counter >= value (mode 0 stream wait value, 1 spin kernel: fo_wait_counter).
cudaError_t wait_counter(const int32_t* counter, int32_t value, int mode, cudaStream_t stream);

// The same wait, then *counter = 0 on `stream` (a stream memory write in mode 0, by the spin
// kernel in mode 1): once a group's counter reached its tile count no tile of the call adds to
// it again, so its waiter can zero it for the next call, and no kernel after the call has to.
cudaError_t wait_counter_and_reset(int32_t* counter, int32_t value, int mode, cudaStream_t stream);

// *address = value on `stream` once its earlier work is done (cuStreamWriteValue32 with its
// default memory barrier, through the driver entry point).
cudaError_t write_value32(void* address, uint32_t value, cudaStream_t stream);

// Resolves the driver's stream wait and write (cuStreamWaitValue32, cuStreamWriteValue32) now,
// not first inside a capture: an error when the driver lacks them.
cudaError_t load_stream_memops();

// Zeroes a call's `n` group counters on `stream` with one CTA (when no post-reorder does it).
cudaError_t launch_reset(int32_t* counters, int n, cudaStream_t stream);

// The launch of the post-reorder of one block (fo_unpack_tiles's arguments; it also zeroes
// `num_reset` counters at `reset`): its grid and its argument values, kept together so that a
// replayed graph's node can be re-pointed at a new `dst` with the same launch.
struct UnpackLaunch {
  static constexpr int kArgs = 8;
  dim3 grid;
  const char* src;
  char* dst;
  int64_t ldd;
  const int32_t* tiles;
  const int64_t* src_offsets;
  int elem_size;
  int32_t* reset;
  int num_reset;

  UnpackLaunch(const void* src_, void* dst_, int64_t ldd_, const int32_t* tiles_,
               const int64_t* src_offsets_, int num_tiles, int elem_size_, int32_t* reset_,
               int num_reset_);

  // Node parameters pointing at this object's fields (valid while it lives).
  cudaKernelNodeParams node(void** args);
};

cudaError_t launch_unpack(const UnpackLaunch& u, cudaStream_t stream);
cudaError_t launch_unpack(const void* src, void* dst, int64_t ldd, const int32_t* tiles,
                          const int64_t* src_offsets, int num_tiles, int elem_size,
                          int32_t* reset, int num_reset, cudaStream_t stream);

// The kernels of the other translation units, force-loaded by fo_load_kernels.
cudaError_t load_norm_kernels();  // add_rmsnorm.cu
cudaError_t load_a2a_kernels();   // all_to_all_call.cu

}  // namespace fo::runtime
