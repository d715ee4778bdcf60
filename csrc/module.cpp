// Importing rl_engine._C only loads this library, which registers the ops with the dispatcher;
// there is no Python-level API here (everything is reached through torch.ops.rl_engine).
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
