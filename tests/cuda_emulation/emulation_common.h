// Helpers shared by the CUDA-kernel emulation programs (emulate_kernels.cpp,
// emulate_block_kernels.cpp): dtype names, the tolerance table and the
// error measures against float64.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace emulation {

template <typename T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<T, double>) return "float64";
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, c10::BFloat16>) return "bfloat16";
  return "float16";
}

// Whether a dtype's cases are compiled in: every dtype, or with
// -DATTNRES_EMULATE_ONLY='"bfloat16"' (a dtype_name) that one alone, so a
// sanitized build instantiates only the kernels it runs (make sanitize
// compiles one emulator per dtype, side by side).
template <typename T>
constexpr bool compiled_in() {
#ifdef ATTNRES_EMULATE_ONLY
  return std::string_view(dtype_name<T>()) == ATTNRES_EMULATE_ONLY;
#else
  return true;
#endif
}

// One row of tests/tolerances.txt (the project's one tolerance table):
// relative errors ||x - ref|| / ||ref|| allowed against float64.
struct Tolerance {
  double output, grad, stats;
};

inline Tolerance read_tolerance(const std::string& dtype) {
  std::ifstream in(ATTNRES_TOLERANCES_FILE);
  if (!in) throw std::runtime_error("cannot read " ATTNRES_TOLERANCES_FILE);
  std::vector<std::string> header;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::vector<std::string> cols;
    for (std::string w; words >> w;) cols.push_back(w);
    if (cols.empty() || cols[0][0] == '#') continue;
    if (cols[0] == "dtype") {
      header = cols;
      continue;
    }
    if (cols[0] != dtype) continue;
    std::map<std::string, double> row;
    for (size_t k = 1; k < cols.size() && k < header.size(); ++k) {
      row[header[k]] = std::atof(cols[k].c_str());
    }
    if (!row.count("output") || !row.count("grad") || !row.count("stats")) break;
    return {row["output"], row["grad"], row["stats"]};
  }
  throw std::runtime_error("no output/grad/stats row for " + dtype + " in " ATTNRES_TOLERANCES_FILE);
}

// Whether two result buffers hold the same bytes (empty ones do: memcmp
// must not see their null data).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Relative error of the norms, both divided by max|want| first (values
// near the dtype's maximum must not overflow the squares).
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double m = 0;
  for (double w : want) m = std::max(m, std::fabs(w));
  if (!(m > 0) || std::isinf(m)) m = 1;
  double num = 0, den = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const double d = got[k] / m - want[k] / m;
    num += d * d;
    den += (want[k] / m) * (want[k] / m);
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

}  // namespace emulation
