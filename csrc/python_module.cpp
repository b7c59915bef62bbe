// Makes the op library importable as `attnres._C`: importing it runs the
// TORCH_LIBRARY registrations. It defines no Python functions; everything is
// reached through torch.ops.attnres.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                                          "attnres torch ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
