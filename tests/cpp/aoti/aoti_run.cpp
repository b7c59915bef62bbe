// Runs an AOTInductor package (.pt2) from C++ and writes its outputs, so that
// tests/python/test_export.py can compare them with Python's.
//
//   aoti_run <model.pt2> <inputs.pt> <outputs.pt> [<expected.pt> [rtol atol]]
//
// inputs.pt:   torch.save([[t, ...], [t, ...], ...]) from Python: a list of
//              calls, each the list of the model's input tensors.
// outputs.pt:  written with torch::jit::pickle_save, read in Python with
//              torch.load: [[out, ...], ...], one list per call.
// expected.pt: optional, the same layout as outputs.pt (torch.save from
//              Python); every output must match it (allclose, rtol/atol
//              default 1e-5) or the program exits with status 1.
// Exit status: 0 ok, 1 outputs differ from expected.pt, 2 usage, 3 error
// (message on stderr).
//
// The package's compiled code calls torch.ops.attnres.depth_attention_fwd
// through the dispatcher. This program links attnres::attnres, whose library
// registers the ops when it loads; the program itself calls no attnres
// function. Built without it (aoti_run_without_attnres), the package fails
// to load: "Could not find schema for attnres::depth_attention_fwd."
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::vector<char>& data) {
  std::ofstream f(path, std::ios::binary);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// [[Tensor, ...], ...] from a file written by torch.save (or pickle_save).
std::vector<std::vector<at::Tensor>> load_calls(const std::string& path) {
  c10::IValue value = torch::jit::pickle_load(read_file(path));
  if (!value.isList()) throw std::runtime_error(path + ": expected a list of tensor lists");
  std::vector<std::vector<at::Tensor>> calls;
  for (const c10::IValue& call : value.toListRef()) {
    if (!call.isList()) throw std::runtime_error(path + ": expected a list of tensor lists");
    std::vector<at::Tensor> tensors;
    for (const c10::IValue& t : call.toListRef()) {
      if (!t.isTensor()) throw std::runtime_error(path + ": expected a list of tensor lists");
      tensors.push_back(t.toTensor());
    }
    calls.push_back(std::move(tensors));
  }
  return calls;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5 && argc != 7) {
    std::fprintf(stderr,
                 "usage: %s <model.pt2> <inputs.pt> <outputs.pt> [<expected.pt> [rtol atol]]\n",
                 argv[0]);
    return 2;
  }
  try {
    const auto calls = load_calls(argv[2]);
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);

    c10::impl::GenericList all_outputs(c10::AnyType::get());
    std::vector<std::vector<at::Tensor>> results;
    for (const auto& inputs : calls) {
      std::vector<at::Tensor> outputs = loader.run(inputs);
      c10::List<at::Tensor> list;
      for (const auto& t : outputs) list.push_back(t);
      all_outputs.push_back(list);
      results.push_back(std::move(outputs));
    }
    write_file(argv[3], torch::jit::pickle_save(all_outputs));
    std::cout << "ran " << calls.size() << " call(s), wrote " << argv[3] << "\n";

    if (argc >= 5) {
      const double rtol = argc == 7 ? std::atof(argv[5]) : 1e-5;
      const double atol = argc == 7 ? std::atof(argv[6]) : 1e-5;
      const auto expected = load_calls(argv[4]);
      bool ok = true;
      if (expected.size() != results.size()) {
        std::cout << argv[4] << " has " << expected.size() << " call(s), ran " << results.size()
                  << "\n";
        ok = false;
      }
      for (size_t c = 0; ok && c < results.size(); ++c) {
        if (expected[c].size() != results[c].size()) {
          std::cout << "call " << c << ": " << results[c].size() << " output(s), expected "
                    << expected[c].size() << "\n";
          ok = false;
        }
        for (size_t i = 0; ok && i < results[c].size(); ++i) {
          const at::Tensor& got = results[c][i];
          const at::Tensor& want = expected[c][i];
          if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
            std::cout << "call " << c << " output " << i << ": got " << got.sizes() << " "
                      << got.scalar_type() << ", expected " << want.sizes() << " "
                      << want.scalar_type() << "\n";
            ok = false;
            break;
          }
          const double diff =
              got.numel() == 0 ? 0.0 : (got - want).abs().max().item<double>();
          ok = at::allclose(got, want, rtol, atol);
          std::cout << "call " << c << " output " << i << " " << got.sizes()
                    << ": max abs diff " << diff << (ok ? "" : "  MISMATCH") << "\n";
        }
      }
      if (!ok) {
        std::cout << "outputs do not match " << argv[4] << "\n";
        return 1;
      }
      std::cout << "outputs match " << argv[4] << " (rtol " << rtol << ", atol " << atol << ")\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
