#include "kernels/cublas_api.h"

#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace trainsim::cuda {

namespace {

// The library by its soname (LD_LIBRARY_PATH, the executable's run path, the system's cache),
// else in the folder CMake linked the build against.
void* open_library(const std::string& soname) {
  if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
  const std::string first_error = dlerror();
#ifdef TRAINSIM_CUBLAS_DIR
  const std::string path = std::string(TRAINSIM_CUBLAS_DIR) + "/" + soname;
  if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
  throw std::runtime_error("cannot load " + soname + " for the matrix products: " + first_error + "; nor " + path +
                           ": " + dlerror());
#else
  throw std::runtime_error("cannot load " + soname + " for the matrix products: " + first_error);
#endif
}

template <class F>
void resolve(void* library, const std::string& soname, const char* symbol, F& entry) {
  entry = reinterpret_cast<F>(dlsym(library, symbol));
  if (!entry) throw std::runtime_error(soname + " has no " + symbol + " (a cuBLAS older than the headers?)");
}

// The sonames of the major version the headers declare (cuBLAS's major is the toolkit's, which
// scripts/device-check looks for on a machine whose loader does not know them).
#define TRAINSIM_SONAME_VERSION(major) #major
#define TRAINSIM_SONAME(library, major) "lib" library ".so." TRAINSIM_SONAME_VERSION(major)

CublasApi open_cublas() {
  const std::string lt_name = TRAINSIM_SONAME("cublasLt", CUBLAS_VER_MAJOR);
  const std::string blas_name = TRAINSIM_SONAME("cublas", CUBLAS_VER_MAJOR);
  void* lt = open_library(lt_name);
  void* blas = open_library(blas_name);
  CublasApi api;
#define TRAINSIM_CUBLAS_RESOLVE(member, symbol, ...) resolve(blas, blas_name, #symbol, api.member);
#define TRAINSIM_CUBLASLT_RESOLVE(member, symbol) resolve(lt, lt_name, #symbol, api.member);
  TRAINSIM_CUBLAS_ENTRIES(TRAINSIM_CUBLAS_RESOLVE)
  TRAINSIM_CUBLAS_OVERLOADED_ENTRIES(TRAINSIM_CUBLAS_RESOLVE)
  TRAINSIM_CUBLASLT_ENTRIES(TRAINSIM_CUBLASLT_RESOLVE)
#undef TRAINSIM_CUBLAS_RESOLVE
#undef TRAINSIM_CUBLASLT_RESOLVE
  return api;
}

}  // namespace

const CublasApi& cublas() {
  static const CublasApi api = open_cublas();
  return api;
}

}  // namespace trainsim::cuda
