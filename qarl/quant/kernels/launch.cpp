// qarl's fake-quant kernel launcher: one call of qarl/quant/kernels/gpu.py's NVFP4 or FP8 Triton kernel
// from C++, for the policy's input quantizers, which launch one in every layer of every forward.
//
// Why C++: a launch-bound forward waits on its host, and a launch through Python (argument checks, the
// output's allocation, the grid and integer arguments, the specialization lookup, the driver call) costs
// more host time than an aten op. Here the same steps are a few C++ lines.
//
// What it launches is decided in Python: gpu._launch launches each specialization through
// Triton first, then registers Triton's compiled function here (`add`) and checks this launcher's
// output against Triton's bit for bit. A call whose specialization is not registered, or that this
// launcher does not take (not a CUDA tensor of a handled dtype, an amax on another device, a pointer
// not 16-byte aligned, an integer argument of 1 or too large a tensor), returns None and the caller
// takes the Python path. No CUDA header is needed: the driver's cuLaunchKernel is looked up in libcuda,
// the current stream comes from c10's device-generic interface.

#include <torch/python.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using CuLaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                               unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                               void* stream, void** params, void** extra);

CuLaunchKernel cu_launch_kernel() {
  static CuLaunchKernel launch = [] {
    void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    void* symbol = libcuda ? dlsym(libcuda, "cuLaunchKernel") : nullptr;
    if (symbol == nullptr) throw std::runtime_error("qarl launcher: cuLaunchKernel not found in libcuda.so.1");
    return reinterpret_cast<CuLaunchKernel>(symbol);
  }();
  return launch;
}

// The dtype codes of the key: the kernels take fp32, bf16 and fp16 inputs; the amax may be any of them.
int dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

bool aligned(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

constexpr int kMaxInts = 3;     // NVFP4: n_cols, blocks_per_row, n_blocks; FP8: n
constexpr int kMaxScratch = 2;  // Triton's trailing scratch pointers, passed null

struct Kernel {
  void* function;
  unsigned threads, shared_bytes;
  std::vector<int> int_bytes;  // 4 or 8: each integer parameter's width in the PTX entry
  int scratch;                 // how many null scratch pointers follow
};

// What one call launches: the integer arguments, the grid, and the key of the specialization.
struct Plan {
  std::int64_t ints[kMaxInts];
  int n_ints;
  std::int64_t programs;
  std::int64_t key;  // -1: not a call this launcher takes
};

class Launcher {
 public:
  // nvfp4: the NVFP4 kernel (per_program 16-element blocks a program), else the FP8 one (per_program elements).
  Launcher(bool nvfp4, std::int64_t per_program) : nvfp4_(nvfp4), per_program_(per_program) {}

  // Register Triton's compiled `function` for the specialization that (x, amax) launch; false (nothing
  // registered) for a call this launcher does not take.
  bool add(const at::Tensor& x, const at::Tensor& amax, std::uint64_t function, unsigned threads,
           unsigned shared_bytes, std::vector<int> int_bytes, int scratch) {
    Plan plan = plan_of(x, amax);
    if (plan.key < 0) return false;
    if (static_cast<int>(int_bytes.size()) != plan.n_ints || scratch < 0 || scratch > kMaxScratch)
      throw std::invalid_argument("qarl launcher: parameter list does not match the kernel's arguments");
    kernels_[plan.key] = Kernel{reinterpret_cast<void*>(function), threads, shared_bytes, std::move(int_bytes), scratch};
    return true;
  }

  void drop(const at::Tensor& x, const at::Tensor& amax) { kernels_.erase(plan_of(x, amax).key); }

  std::size_t size() const { return kernels_.size(); }

  // The kernel's output for x (x's dtype and shape, contiguous), or None where the caller must launch.
  py::object call(const at::Tensor& x, const at::Tensor& amax) const {
    Plan plan = plan_of(x, amax);
    if (plan.key < 0) return py::none();
    auto found = kernels_.find(plan.key);
    if (x.numel() == 0) return py::cast(at::empty_like(x, at::MemoryFormat::Contiguous));
    if (found == kernels_.end()) return py::none();
    const Kernel& kernel = found->second;
    at::Tensor input = x.contiguous();
    if (!aligned(input.const_data_ptr())) return py::none();  // a copy made here is aligned; a view may not be
    at::Tensor output = at::empty_like(input, at::MemoryFormat::Contiguous);
    if (!aligned(output.const_data_ptr())) return py::none();

    std::uint64_t values[3 + kMaxInts + kMaxScratch] = {};
    void* params[3 + kMaxInts + kMaxScratch];
    values[0] = reinterpret_cast<std::uintptr_t>(input.const_data_ptr());
    values[1] = reinterpret_cast<std::uintptr_t>(output.data_ptr());
    values[2] = reinterpret_cast<std::uintptr_t>(amax.const_data_ptr());
    int n = 3;
    for (int i = 0; i < plan.n_ints; ++i, ++n) {
      if (kernel.int_bytes[i] == 4) {
        std::uint32_t narrow = static_cast<std::uint32_t>(plan.ints[i]);
        std::memcpy(&values[n], &narrow, sizeof narrow);
      } else {
        values[n] = static_cast<std::uint64_t>(plan.ints[i]);
      }
    }
    n += kernel.scratch;  // null pointers (zeroed above)
    for (int i = 0; i < n; ++i) params[i] = &values[i];

    const c10::Device device = input.device();
    const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::OptionalDeviceGuard guard;
    if (cuda->getDevice() != device) guard.reset_device(device);  // the function belongs to x's device's context
    void* stream = cuda->getStreamNativeHandle(cuda->getStream(device));
    int status = cu_launch_kernel()(kernel.function, static_cast<unsigned>(plan.programs), 1, 1, kernel.threads, 1, 1,
                                    kernel.shared_bytes, stream, params, nullptr);
    if (status != 0) throw std::runtime_error("qarl launcher: cuLaunchKernel failed with CUDA error " + std::to_string(status));
    return py::cast(output);
  }

 private:
  // The arguments gpu._nvfp4 / _fp8 pass, and a key holding everything gpu._launch keys
  // Triton's specialization on for this kernel and launch options: the device, x's and amax's dtypes (the
  // output has x's), and each integer's divisibility by 16 and width (a value of 1, which Triton
  // specializes away, is not taken). Pointer alignment is checked at the call (aligned ones only).
  Plan plan_of(const at::Tensor& x, const at::Tensor& amax) const {
    Plan plan{{0, 0, 0}, 0, 0, -1};
    const int x_code = dtype_code(x.scalar_type()), amax_code = dtype_code(amax.scalar_type());
    if (!x.is_cuda() || x.dim() == 0 || x_code < 0 || amax_code < 0 || amax.device() != x.device() ||
        amax.numel() != 1 || !aligned(amax.const_data_ptr()))
      return plan;
    const std::int64_t numel = x.numel();
    if (nvfp4_) {
      const std::int64_t n_cols = x.size(-1), blocks_per_row = (n_cols + 15) / 16;
      const std::int64_t n_blocks = n_cols == 0 ? 0 : numel / n_cols * blocks_per_row;
      if (n_blocks >= (std::int64_t{1} << 31) - per_program_) return plan;  // the Python path raises
      plan.ints[0] = n_cols, plan.ints[1] = blocks_per_row, plan.ints[2] = n_blocks, plan.n_ints = 3;
      plan.programs = (n_blocks + per_program_ - 1) / per_program_;
    } else {
      plan.ints[0] = numel, plan.n_ints = 1;
      plan.programs = (numel + per_program_ - 1) / per_program_;
    }
    if (plan.programs >= (std::int64_t{1} << 31)) return plan;
    std::int64_t key = (x.get_device() * 3 + x_code) * 3 + amax_code;
    for (int i = 0; i < plan.n_ints; ++i) {
      const std::int64_t value = plan.ints[i];
      if (value == 1) return plan;
      key = key * 4 + (value % 16 == 0) * 2 + (value < (std::int64_t{1} << 31));
    }
    plan.key = key;
    return plan;
  }

  bool nvfp4_;
  std::int64_t per_program_;
  std::unordered_map<std::int64_t, Kernel> kernels_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Launcher>(m, "Launcher")
      .def(py::init<bool, std::int64_t>())
      .def("add", &Launcher::add)
      .def("drop", &Launcher::drop)
      .def("__len__", &Launcher::size)
      .def("__call__", &Launcher::call);
}
