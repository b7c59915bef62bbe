// Makes the op library importable as `attnres._C`: importing it runs the
// TORCH_LIBRARY registrations. Every op is reached through
// torch.ops.attnres; besides, _C has a direct call of the reads a decode
// step makes (depth_attention_fwd, block_reads_fwd, block_read_merge_fwd,
// block_read_merge_inplace). It calls the same op through the dispatcher
// (autograd, vmap, fake tensors and every device kernel as usual) without
// torch.ops' boxed argument parsing, which costs about as much as a T = 1
// read itself (docs/design.md §12). Arguments it does not take as they are
// (a tensor subclass, a torch function mode: anything __torch_function__
// may handle) make it return NotImplemented, and the caller goes through
// torch.ops; so do calls under torch.compile (python/attnres/ops.py).
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

// An argument as the op takes it: a plain tensor (or nn.Parameter), or None
// for an optional one; false for anything else.
bool as_tensor(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

bool as_optional(PyObject* obj, std::optional<at::Tensor>& out) {
  if (obj == Py_None) return true;
  at::Tensor t;
  if (!as_tensor(obj, t)) return false;
  out = std::move(t);
  return true;
}

// A float argument as the op's `float`: a Python float only (anything else
// is torch.ops' to convert or refuse).
bool as_double(PyObject* obj, double& out) {
  if (!PyFloat_CheckExact(obj)) return false;
  out = PyFloat_AS_DOUBLE(obj);
  return true;
}

bool as_optional_double(PyObject* obj, std::optional<double>& out) {
  if (obj == Py_None) return true;
  double value;
  if (!as_double(obj, value)) return false;
  out = value;
  return true;
}

bool as_tensor_list(PyObject* obj, std::vector<at::Tensor>& out) {
  if (!PyList_CheckExact(obj)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(obj);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!as_tensor(PyList_GET_ITEM(obj, i), out[i])) return false;
  }
  return true;
}

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// Tensors as a Python tuple (a new reference; none leaks if wrapping fails).
PyObject* tensors_tuple(std::initializer_list<at::Tensor> tensors) {
  THPObjectPtr tuple(PyTuple_New(static_cast<Py_ssize_t>(tensors.size())));
  if (!tuple) return nullptr;
  Py_ssize_t i = 0;
  for (const auto& t : tensors) {
    PyObject* item = THPVariable_Wrap(t);
    if (!item) return nullptr;
    PyTuple_SET_ITEM(tuple.get(), i++, item);
  }
  return tuple.release();
}


// depth_attention_fwd(sources, query, norm_weight, eps, scale, out_weight,
// out_eps, keep_h, delta): the op's arguments, all positional.
PyObject* depth_attention_fwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *sources_obj, *query_obj, *gain_obj, *eps_obj, *scale_obj, *out_weight_obj,
      *out_eps_obj, *keep_h_obj, *delta_obj;
  if (!PyArg_UnpackTuple(args, "depth_attention_fwd", 9, 9, &sources_obj, &query_obj, &gain_obj,
                         &eps_obj, &scale_obj, &out_weight_obj, &out_eps_obj, &keep_h_obj,
                         &delta_obj)) {
    return nullptr;
  }
  std::vector<at::Tensor> sources;
  at::Tensor query;
  std::optional<at::Tensor> gain, out_weight, delta;
  std::optional<double> out_eps;
  double eps, scale;
  if (at::impl::torch_function_mode_enabled() || !as_tensor_list(sources_obj, sources) ||
      !as_tensor(query_obj, query) || !as_optional(gain_obj, gain) || !as_double(eps_obj, eps) ||
      !as_double(scale_obj, scale) || !as_optional(out_weight_obj, out_weight) ||
      !as_optional_double(out_eps_obj, out_eps) || !PyBool_Check(keep_h_obj) ||
      !as_optional(delta_obj, delta)) {
    return not_implemented();
  }
  const bool keep_h = keep_h_obj == Py_True;
  attnres::DepthAttentionForward result;
  {
    pybind11::gil_scoped_release no_gil;
    result = attnres::depth_attention_fwd(sources, query, gain, eps, scale, out_weight, out_eps,
                                          keep_h, delta);
  }
  auto& [out, rstd, weights, h, out_rstd, prefix_out] = result;
  return tensors_tuple({out, rstd, weights, h, out_rstd, prefix_out});
  END_HANDLE_TH_ERRORS
}

// block_reads_fwd(sources, queries, norm_weights, eps, scale, out_weight,
// out_eps, keep_h): phase 1, once per block.
PyObject* block_reads_fwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *sources_obj, *queries_obj, *gains_obj, *eps_obj, *scale_obj, *out_weight_obj,
      *out_eps_obj, *keep_h_obj;
  if (!PyArg_UnpackTuple(args, "block_reads_fwd", 8, 8, &sources_obj, &queries_obj, &gains_obj,
                         &eps_obj, &scale_obj, &out_weight_obj, &out_eps_obj, &keep_h_obj)) {
    return nullptr;
  }
  std::vector<at::Tensor> sources;
  at::Tensor queries;
  std::optional<at::Tensor> gains, out_weight;
  std::optional<double> out_eps;
  double eps, scale;
  if (at::impl::torch_function_mode_enabled() || !as_tensor_list(sources_obj, sources) ||
      !as_tensor(queries_obj, queries) || !as_optional(gains_obj, gains) ||
      !as_double(eps_obj, eps) || !as_double(scale_obj, scale) ||
      !as_optional(out_weight_obj, out_weight) || !as_optional_double(out_eps_obj, out_eps) ||
      !PyBool_Check(keep_h_obj)) {
    return not_implemented();
  }
  attnres::BlockReadsForward result;
  {
    pybind11::gil_scoped_release no_gil;
    result = attnres::block_reads_fwd(sources, queries, gains, eps, scale, out_weight, out_eps,
                                      keep_h_obj == Py_True);
  }
  auto& [partial_outs, lse, rstd, weights, h, out_rstd] = result;
  THPObjectPtr partials(PyList_New(static_cast<Py_ssize_t>(partial_outs.size())));
  if (!partials) return nullptr;
  for (size_t i = 0; i < partial_outs.size(); ++i) {
    PyObject* item = THPVariable_Wrap(partial_outs[i]);
    if (!item) return nullptr;
    PyList_SET_ITEM(partials.get(), static_cast<Py_ssize_t>(i), item);
  }
  THPObjectPtr rest(tensors_tuple({lse, rstd, weights, h, out_rstd}));
  if (!rest) return nullptr;
  THPObjectPtr tuple(PyTuple_New(6));
  if (!tuple) return nullptr;
  PyTuple_SET_ITEM(tuple.get(), 0, partials.release());
  for (Py_ssize_t i = 0; i < 5; ++i) {
    PyObject* item = PyTuple_GET_ITEM(rest.get(), i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(tuple.get(), i + 1, item);
  }
  return tuple.release();
  END_HANDLE_TH_ERRORS
}

// block_read_merge_fwd(partial_out, lse, block_sum, query, norm_weight, eps,
// scale, out_weight, out_eps, keep_h, delta) and block_read_merge_inplace
// (the same without keep_h).
PyObject* merge(PyObject* args, bool in_place) {
  PyObject *partial_obj, *lse_obj, *sum_obj, *query_obj, *gain_obj, *eps_obj, *scale_obj,
      *out_weight_obj, *out_eps_obj, *keep_h_obj = Py_False, *delta_obj;
  const bool parsed =
      in_place ? PyArg_UnpackTuple(args, "block_read_merge_inplace", 10, 10, &partial_obj,
                                   &lse_obj, &sum_obj, &query_obj, &gain_obj, &eps_obj,
                                   &scale_obj, &out_weight_obj, &out_eps_obj, &delta_obj)
               : PyArg_UnpackTuple(args, "block_read_merge_fwd", 11, 11, &partial_obj, &lse_obj,
                                   &sum_obj, &query_obj, &gain_obj, &eps_obj, &scale_obj,
                                   &out_weight_obj, &out_eps_obj, &keep_h_obj, &delta_obj);
  if (!parsed) return nullptr;
  at::Tensor partial, lse, block_sum, query;
  std::optional<at::Tensor> gain, out_weight, delta;
  std::optional<double> out_eps;
  double eps, scale;
  if (at::impl::torch_function_mode_enabled() || !as_tensor(partial_obj, partial) ||
      !as_tensor(lse_obj, lse) || !as_tensor(sum_obj, block_sum) ||
      !as_tensor(query_obj, query) || !as_optional(gain_obj, gain) || !as_double(eps_obj, eps) ||
      !as_double(scale_obj, scale) || !as_optional(out_weight_obj, out_weight) ||
      !as_optional_double(out_eps_obj, out_eps) || !PyBool_Check(keep_h_obj) ||
      !as_optional(delta_obj, delta)) {
    return not_implemented();
  }
  const bool keep_h = keep_h_obj == Py_True;
  if (in_place) {
    at::Tensor sum;
    {
      pybind11::gil_scoped_release no_gil;
      sum = attnres::block_read_merge_inplace(partial, lse, block_sum, query, gain, eps, scale,
                                              out_weight, out_eps, delta);
    }
    return THPVariable_Wrap(sum);
  }
  attnres::MergeForward result;
  {
    pybind11::gil_scoped_release no_gil;
    result = attnres::block_read_merge_fwd(partial, lse, block_sum, query, gain, eps, scale,
                                           out_weight, out_eps, keep_h, delta);
  }
  auto& [out, rstd, weight, h, out_rstd, sum] = result;
  return tensors_tuple({out, rstd, weight, h, out_rstd, sum});
}

PyObject* block_read_merge_fwd(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  return merge(args, /*in_place=*/false);
  END_HANDLE_TH_ERRORS
}

PyObject* block_read_merge_inplace(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  return merge(args, /*in_place=*/true);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"depth_attention_fwd", depth_attention_fwd, METH_VARARGS,
     "torch.ops.attnres.depth_attention_fwd's direct call, or NotImplemented"},
    {"block_reads_fwd", block_reads_fwd, METH_VARARGS,
     "torch.ops.attnres.block_reads_fwd's direct call, or NotImplemented"},
    {"block_read_merge_fwd", block_read_merge_fwd, METH_VARARGS,
     "torch.ops.attnres.block_read_merge_fwd's direct call, or NotImplemented"},
    {"block_read_merge_inplace", block_read_merge_inplace, METH_VARARGS,
     "torch.ops.attnres.block_read_merge_inplace's direct call, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "attnres torch ops", -1,
                                          methods};
  return PyModule_Create(&module_def);
}
