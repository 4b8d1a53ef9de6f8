// The launch of a persistent sm90 GEMM on clusters of CM x CN CTAs, written once for every
// library that has one (gemm_sm90.cu, gemm_sm90_stock.cu): its grid, the CTAs resident at once,
// a launch on a stream, and a captured launch (a kernel node of an instantiated graph)
// re-pointed at new parameters.
#pragma once
#include "common.cuh"

namespace fo {

template <int CM, int CN, class Params>
struct ClusterLaunch {
  static constexpr int kClusterSize = CM * CN;
  void (*kernel)(Params);
  int threads;
  int smem_bytes;

  // Grid (CM * clusters, CN): CTA rank rm + rn * CM of cluster c takes items c * CM * CN + rank
  // of each round (gemm_api.h, "Clusters").
  cudaLaunchConfig_t config(int num_ctas, cudaLaunchAttribute* attr) const {
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = CM, attr->val.clusterDim.y = CN, attr->val.clusterDim.z = 1;
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(CM * (num_ctas / kClusterSize), CN, 1);
    c.blockDim = dim3(threads, 1, 1);
    c.dynamicSmemBytes = smem_bytes;
    c.attrs = attr;
    c.numAttrs = 1;
    return c;
  }

  cudaError_t resident_ctas(int* ctas) const {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t c = config(kClusterSize, &attr);
    int clusters = 0;
    FO_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &c));
    *ctas = clusters * kClusterSize;
    return cudaSuccess;
  }

  cudaError_t launch(const Params& params, int num_ctas, cudaStream_t stream) const {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t c = config(num_ctas, &attr);
    c.stream = stream;
    FO_CUDA_CHECK(cudaLaunchKernelEx(&c, kernel, params));
    return cudaSuccess;
  }

  // The node keeps the cluster dimension it was captured with (a launch attribute, which
  // cudaGraphExecKernelNodeSetParams leaves alone); grid, block and shared memory are as captured.
  cudaError_t set_node(Params& params, int num_ctas, cudaGraphExec_t exec,
                       cudaGraphNode_t node) const {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t c = config(num_ctas, &attr);
    void* arg[] = {&params};
    cudaKernelNodeParams p = {};
    p.func = reinterpret_cast<void*>(kernel);
    p.gridDim = c.gridDim, p.blockDim = c.blockDim;
    p.sharedMemBytes = c.dynamicSmemBytes;
    p.kernelParams = arg;
    FO_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, node, &p));
    return cudaSuccess;
  }
};

}  // namespace fo
