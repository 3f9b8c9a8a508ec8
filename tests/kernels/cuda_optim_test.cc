// CUDA kernels against the CPU kernels, bit for bit (label: gpu; skipped without a GPU): the
// optimizer's and the 4-bit dequantization.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/kernels/cpu_optim.h"
#include "strata/kernels/cuda_optim.h"
#include "strata/kernels/cuda_quant4.h"

namespace strata::kernels {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    for (void* p : allocs_) cudaFree(p);
    if (stream_) cudaStreamDestroy(stream_);
  }
  template <class T>
  T* upload(const std::vector<T>& v) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))), cudaSuccess);
    allocs_.push_back(d);
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<T*>(d);
  }
  template <class T>
  std::vector<T> download(const T* d, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocs_;
};

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST_F(CudaKernels, MultiTensorAdamMatchesTheCpuKernelBitwise) {
  const std::vector<size_t> sizes = {1, 7, 1000003, 4096, 70000};
  for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool adamw : {false, true}) {
      std::vector<std::vector<float>> p, m, v;
      std::vector<std::vector<uint16_t>> g16, out16;
      std::vector<std::vector<float>> g32;
      std::vector<cuda::AdamTensor> dev;
      for (size_t i = 0; i < sizes.size(); ++i) {
        const size_t n = sizes[i];
        p.push_back(randn(n, 10 + i));
        m.emplace_back(n, 0.0f);
        v.emplace_back(n, 0.0f);
        g32.push_back(randn(n, 100 + i, 3.0f));
        g16.emplace_back(n);
        if (gt != DType::kF32) convert(g32.back().data(), DType::kF32, g16.back().data(), gt, n);
        out16.emplace_back(n);
        dev.push_back({upload(p.back()), upload(m.back()), upload(v.back()),
                       gt == DType::kF32 ? static_cast<const void*>(upload(g32.back()))
                                         : upload(g16.back()),
                       upload(out16.back()), n});
      }
      for (int64_t step = 1; step <= 5; ++step) {
        AdamConfig c{1e-3, 0.9, 0.999, 1e-8, 0.1, adamw, step, 0.5};
        cuda::adam_step(c, dev.data(), dev.size(), gt, DType::kBF16, stream_);
        for (size_t i = 0; i < sizes.size(); ++i) {
          const void* g = gt == DType::kF32 ? static_cast<const void*>(g32[i].data()) : g16[i].data();
          adam_step(c, p[i].data(), m[i].data(), v[i].data(), g, gt, out16[i].data(), DType::kBF16,
                    sizes[i], {2});
        }
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        const size_t n = sizes[i];
        EXPECT_EQ(0, std::memcmp(download(dev[i].param, n).data(), p[i].data(), n * 4)) << i;
        EXPECT_EQ(0, std::memcmp(download(dev[i].exp_avg, n).data(), m[i].data(), n * 4)) << i;
        EXPECT_EQ(0, std::memcmp(download(dev[i].exp_avg_sq, n).data(), v[i].data(), n * 4)) << i;
        EXPECT_EQ(download(static_cast<uint16_t*>(dev[i].param_out), n), out16[i]) << i;
      }
    }
  }
}

TEST_F(CudaKernels, SumSquaresUnscaleAndConvertMatchTheCpuKernels) {
  for (size_t n : {1ul, 4095ul, 4097ul, 1000003ul}) {
    const auto x = randn(n, n, 5.0f);
    float* dx = upload(x);
    double* dsum = upload(std::vector<double>(1, -1.0));
    cuda::sum_squares(dx, DType::kF32, n, dsum, stream_);
    EXPECT_EQ(download(dsum, 1)[0], sum_squares(x.data(), DType::kF32, n)) << n;

    for (DType t : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> want(n);
      convert(x.data(), DType::kF32, want.data(), t, n);
      uint16_t* dh = upload(std::vector<uint16_t>(n));
      cuda::convert(dx, DType::kF32, dh, t, n, stream_);
      EXPECT_EQ(download(dh, n), want) << to_string(t);
      std::vector<float> back(n);
      convert(want.data(), t, back.data(), DType::kF32, n);
      float* dback = upload(std::vector<float>(n));
      cuda::convert(dh, t, dback, DType::kF32, n, stream_);
      EXPECT_EQ(0, std::memcmp(download(dback, n).data(), back.data(), n * 4));
    }

    std::vector<float> y = x;
    if (n > 5) y[n / 2] = INFINITY;
    float* dy = upload(y);
    int* dflag = upload(std::vector<int>(1, 0));
    cuda::unscale_and_check(dy, 1.0f / 64, n, dflag, stream_);
    const bool cpu_bad = unscale_and_check(y.data(), 1.0f / 64, n);
    EXPECT_EQ(download(dflag, 1)[0] != 0, cpu_bad);
    auto got = download(dy, n);
    EXPECT_EQ(0, std::memcmp(got.data(), y.data(), n * 4));
  }
}

}  // namespace
}  // namespace strata::kernels

namespace strata::kernels {
namespace {

// The 4-bit dequantization (a frozen 4-bit base's binding on a GPU) against the CPU kernel, bitwise:
// NF4 and FP4, blocks of 64 and 256, fp32/bf16/fp16 outputs, odd counts and partial last blocks.
TEST_F(CudaKernels, Dequantize4BitMatchesTheCpuKernelBitwise) {
  for (Quant4 type : {Quant4::kNf4, Quant4::kFp4})
    for (int64_t block : {64, 256})
      for (int64_t n : {1, 63, 4979, 1000003}) {
        const std::vector<float> x = randn(size_t(n), uint64_t(n) * 31 + uint64_t(block), 0.02f);
        std::vector<uint8_t> packed(size_t(quant4_packed_bytes(n)));
        std::vector<float> absmax(size_t(quant4_blocks(n, block)));
        quantize_4bit(x.data(), DType::kF32, n, type, block, packed.data(), absmax.data());
        const uint8_t* dp = upload(packed);
        const float* da = upload(absmax);
        for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
          SCOPED_TRACE(std::string(to_string(type)) + " block " + std::to_string(block) + " n " + std::to_string(n));
          const size_t bytes = size_t(n) * (out == DType::kF32 ? 4 : 2);
          std::vector<uint8_t> want(bytes);
          dequantize_4bit(packed.data(), absmax.data(), n, type, block, want.data(), out);
          uint8_t* dout = upload(std::vector<uint8_t>(bytes, 0xAB));
          cuda::dequantize_4bit(dp, da, n, type, block, dout, out, stream_);
          EXPECT_EQ(download(dout, bytes), want);
        }
      }
}

// Double quantization's absmax back on the GPU against the CPU kernel, bitwise (200, 512 and 778
// 4-bit blocks: a partial nested block of 256, two whole ones, a partial fourth).
TEST_F(CudaKernels, DoubleQuantizedAbsmaxMatchesTheCpuKernelBitwise) {
  for (int64_t n : {64 * 200, 64 * 512, 64 * 777 + 5}) {
    const std::vector<float> x = randn(size_t(n), uint64_t(n), 0.03f);
    const int64_t blocks = quant4_blocks(n, 64);
    std::vector<float> absmax(static_cast<size_t>(blocks));
    quant4_absmax(x.data(), DType::kF32, n, 64, absmax.data());
    double sum = 0;
    for (float a : absmax) sum += a;
    const float offset = float(sum / double(blocks));
    std::vector<uint8_t> packed(size_t(quant4_packed_bytes(n))), qabsmax(static_cast<size_t>(blocks));
    std::vector<float> nested(size_t(quant4_nested_blocks(n, 64)));
    quantize_4bit_nested(x.data(), DType::kF32, n, Quant4::kNf4, 64, offset, packed.data(), qabsmax.data(),
                         nested.data());
    std::vector<float> want(static_cast<size_t>(blocks));
    dequantize_quant4_absmax(qabsmax.data(), nested.data(), offset, blocks, want.data());
    float* dout = upload(std::vector<float>(size_t(blocks), 0.0f));
    cuda::dequantize_quant4_absmax(upload(qabsmax), upload(nested), upload(std::vector<float>{offset}), blocks, dout,
                                   stream_);
    const std::vector<float> got = download(dout, size_t(blocks));
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << n;
  }
}

}  // namespace
}  // namespace strata::kernels
