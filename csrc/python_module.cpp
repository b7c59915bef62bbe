// Makes the op library importable as `attnres._C`: importing it runs the
// TORCH_LIBRARY registrations. Every op is reached through
// torch.ops.attnres; besides, _C has a direct call of the reads a decode
// step makes (depth_attention_fwd, block_reads_fwd, block_read_merge_fwd,
// block_read_merge_inplace). It calls the same op through the dispatcher
// (autograd, vmap, fake tensors and every device kernel as usual) without
// torch.ops' boxed argument parsing, which costs about as much as a T = 1
// read itself (docs/design.md §12); a small call keeps the GIL. Arguments
// it does not take as they are (a tensor subclass, a torch function mode:
// anything __torch_function__ may handle) make it return NotImplemented,
// and the caller goes through torch.ops; so do calls under torch.compile
// (python/attnres/ops.py).
#include <ATen/PythonTorchFunctionTLS.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "attnres/block_reads.h"
#include "attnres/ops.h"

namespace {

// One argument as the op takes it, or false for anything torch.ops should
// see instead: a plain tensor (or nn.Parameter), None for an optional one,
// a Python float for a float, a bool for a bool, a list of tensors.
bool take(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

bool take(PyObject* obj, double& out) {
  if (!PyFloat_CheckExact(obj)) return false;
  out = PyFloat_AS_DOUBLE(obj);
  return true;
}

bool take(PyObject* obj, bool& out) {
  if (!PyBool_Check(obj)) return false;
  out = obj == Py_True;
  return true;
}

template <class T>
bool take(PyObject* obj, std::optional<T>& out) {
  if (obj == Py_None) return true;
  T value;
  if (!take(obj, value)) return false;
  out = std::move(value);
  return true;
}

bool take(PyObject* obj, std::vector<at::Tensor>& out) {
  if (!PyList_CheckExact(obj)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(obj);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!take(PyList_GET_ITEM(obj, i), out[i])) return false;
  }
  return true;
}

enum class Taken { kAll, kNotImplemented, kError };

// A call's arguments (vectorcall): the op's, positional, in the schema's
// order, and the keyword `outputs`, a bit mask of the results to return
// (bit i: result i, the int taken modulo 2^64). The others come back as
// None, unwrapped: a caller that drops most of a read's results does not
// pay for their Python objects.
struct CallArgs {
  PyObject* const* args;
  Py_ssize_t nargs;
  PyObject* kwnames;
};

// The op's arguments, one per output, all taken, and the mask; or
// kNotImplemented (torch.ops should take the call: a torch function mode
// is on, or an argument is not of the op's exact types); or kError (a wrong
// count or keyword: a Python error is set).
template <class... T>
Taken take_args(const CallArgs& call, const char* name, uint64_t& outputs, T&... out) {
  constexpr Py_ssize_t n = sizeof...(T);
  const Py_ssize_t given = PyVectorcall_NARGS(call.nargs);
  if (given != n) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments (%zd given)", name, n, given);
    return Taken::kError;
  }
  outputs = ~uint64_t(0);
  const Py_ssize_t keywords = call.kwnames ? PyTuple_GET_SIZE(call.kwnames) : 0;
  for (Py_ssize_t k = 0; k < keywords; ++k) {
    PyObject* key = PyTuple_GET_ITEM(call.kwnames, k);
    PyObject* value = call.args[given + k];
    if (PyUnicode_CompareWithASCIIString(key, "outputs") != 0 || !PyLong_CheckExact(value)) {
      PyErr_Format(PyExc_TypeError, "%s takes one keyword, outputs (an int mask)", name);
      return Taken::kError;
    }
    outputs = PyLong_AsUnsignedLongLongMask(value);
  }
  if (at::impl::torch_function_mode_enabled()) return Taken::kNotImplemented;
  Py_ssize_t i = 0;
  const bool all = (take(call.args[i++], out) && ...);
  return all ? Taken::kAll : Taken::kNotImplemented;
}

// An op's result as Python objects (new references): a tensor, a list of
// tensors, a tuple of these.
PyObject* wrap(const at::Tensor& t) { return THPVariable_Wrap(t); }

PyObject* wrap(const std::vector<at::Tensor>& tensors) {
  THPObjectPtr list(PyList_New(static_cast<Py_ssize_t>(tensors.size())));
  if (!list) return nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* item = wrap(tensors[i]);
    if (!item) return nullptr;
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(i), item);
  }
  return list.release();
}

bool set_item(PyObject* tuple, Py_ssize_t i, PyObject* item) {
  if (!item) return false;
  PyTuple_SET_ITEM(tuple, i, item);
  return true;
}

// One result: a tensor (the mask does not apply), or a tuple whose items
// outside `outputs` are None.
template <class T>
PyObject* wrap(const T& result, uint64_t /*outputs*/) {
  return wrap(result);
}

template <class... T>
PyObject* wrap(const std::tuple<T...>& result, uint64_t outputs) {
  THPObjectPtr tuple(PyTuple_New(sizeof...(T)));
  if (!tuple) return nullptr;
  Py_ssize_t i = 0;
  const auto put = [&](const auto& item) {
    PyObject* obj = Py_None;
    if ((outputs >> i) & 1) {
      obj = wrap(item);
    } else {
      Py_INCREF(obj);
    }
    return set_item(tuple.get(), i++, obj);
  };
  const bool ok = std::apply([&](const auto&... item) { return (put(item) && ...); }, result);
  return ok ? tuple.release() : nullptr;
}

// The elements of a call's tensor arguments: what its time scales with.
int64_t elements(const at::Tensor& t) { return t.numel(); }
int64_t elements(const std::optional<at::Tensor>& t) { return t ? t->numel() : 0; }
int64_t elements(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
}
template <class T>
int64_t elements(const T&) {
  return 0;
}

// Calls with at most this many elements keep the GIL: releasing and taking
// it back costs ~0.45 us, a tenth of a decode-sized read; such a call runs
// for at most tens of microseconds on a CPU. Larger ones release it.
constexpr int64_t kKeepGilElements = int64_t(1) << 16;

// The direct call of one op: its C++ API function `fn` with the arguments
// taken from `args` (as the schema orders them), the GIL released while a
// large call runs; NotImplemented where torch.ops should take the call.
template <auto fn, class... A>
PyObject* direct_call(const CallArgs& args, const char* name) {
  HANDLE_TH_ERRORS
  std::tuple<A...> values;
  uint64_t outputs = 0;
  const Taken taken =
      std::apply([&](auto&... v) { return take_args(args, name, outputs, v...); }, values);
  if (taken == Taken::kError) return nullptr;
  if (taken == Taken::kNotImplemented) Py_RETURN_NOTIMPLEMENTED;
  const int64_t work = std::apply([](const auto&... v) { return (elements(v) + ...); }, values);
  decltype(std::apply(fn, values)) result;
  if (work <= kKeepGilElements) {
    result = std::apply(fn, values);
  } else {
    pybind11::gil_scoped_release no_gil;
    result = std::apply(fn, values);
  }
  return wrap(result, outputs);
  END_HANDLE_TH_ERRORS
}

using Tensors = std::vector<at::Tensor>;
using OptTensor = std::optional<at::Tensor>;
using OptDouble = std::optional<double>;

// The ops' arguments, positional, in the schemas' order (and `outputs`).
PyObject* depth_attention_fwd(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs,
                              PyObject* kwnames) {
  return direct_call<&attnres::depth_attention_fwd, Tensors, at::Tensor, OptTensor, double,
                     double, OptTensor, OptDouble, bool, OptTensor>({args, nargs, kwnames},
                                                                   "depth_attention_fwd");
}

PyObject* block_reads_fwd(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs,
                          PyObject* kwnames) {
  return direct_call<&attnres::block_reads_fwd, Tensors, at::Tensor, OptTensor, double, double,
                     OptTensor, OptDouble, bool>({args, nargs, kwnames}, "block_reads_fwd");
}

PyObject* block_read_merge_fwd(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs,
                               PyObject* kwnames) {
  return direct_call<&attnres::block_read_merge_fwd, at::Tensor, at::Tensor, at::Tensor,
                     at::Tensor, OptTensor, double, double, OptTensor, OptDouble, bool,
                     OptTensor>({args, nargs, kwnames}, "block_read_merge_fwd");
}

PyObject* block_read_merge_inplace(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs,
                                   PyObject* kwnames) {
  return direct_call<&attnres::block_read_merge_inplace, at::Tensor, at::Tensor, at::Tensor,
                     at::Tensor, OptTensor, double, double, OptTensor, OptDouble, OptTensor>(
      {args, nargs, kwnames}, "block_read_merge_inplace");
}

// A METH_FASTCALL | METH_KEYWORDS function as the method table stores it.
template <PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef methods[] = {
    {"depth_attention_fwd", fastcall<depth_attention_fwd>(), METH_FASTCALL | METH_KEYWORDS,
     "torch.ops.attnres.depth_attention_fwd's direct call, or NotImplemented"},
    {"block_reads_fwd", fastcall<block_reads_fwd>(), METH_FASTCALL | METH_KEYWORDS,
     "torch.ops.attnres.block_reads_fwd's direct call, or NotImplemented"},
    {"block_read_merge_fwd", fastcall<block_read_merge_fwd>(), METH_FASTCALL | METH_KEYWORDS,
     "torch.ops.attnres.block_read_merge_fwd's direct call, or NotImplemented"},
    {"block_read_merge_inplace", fastcall<block_read_merge_inplace>(),
     METH_FASTCALL | METH_KEYWORDS,
     "torch.ops.attnres.block_read_merge_inplace's direct call, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "attnres torch ops", -1,
                                          methods};
  return PyModule_Create(&module_def);
}
