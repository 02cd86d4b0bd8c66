// graft's tensor signature check: the C++ twin of torch's TensorGuards(...).check for the
// remembered argument signatures of graft's dispatch (graft/signature.py), built by
// graft/tensor_guard.py against the installed torch.
//
// A guard made from n tensors is called (vectorcall, no argument tuple) with n objects and
// answers True when each has the same Python type, dispatch key set, dtype, device,
// requires_grad, sizes and strides as the tensor it was made from, and no object is passed
// twice (as torch's check, which never matches one tensor passed twice). It reads those
// fields straight off each TensorImpl: about 0.1 us for five tensors where torch's check,
// which also folds thread-local dispatch state into each key set, takes 0.5 us.
// Anything unusual (symbolic sizes, a tensor type whose sizes cannot be read) answers False,
// and the caller then validates the call in full.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace {

struct Expected {
  PyTypeObject* type;  // a strong reference: a freed subclass's address must not match a new type
  uint64_t keys;
  c10::ScalarType dtype;
  c10::Device device;
  bool requires_grad;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

struct Guard {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  std::vector<Expected>* expected;
};

bool matches(const Expected& e, PyObject* obj) {
  if (Py_TYPE(obj) != e.type)
    return false;
  c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (impl->key_set().raw_repr() != e.keys || impl->dtype().toScalarType() != e.dtype ||
      impl->device() != e.device || impl->requires_grad() != e.requires_grad)
    return false;
  if (impl->has_symbolic_sizes_strides())
    return false;
  c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  if (sizes.size() != e.sizes.size())
    return false;
  for (size_t d = 0; d < sizes.size(); d++)
    if (sizes[d] != e.sizes[d] || strides[d] != e.strides[d])
      return false;
  return true;
}

PyObject* guard_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const std::vector<Expected>& expected = *reinterpret_cast<Guard*>(self)->expected;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || n != static_cast<Py_ssize_t>(expected.size()))
    Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; i++)
    for (Py_ssize_t j = 0; j < i; j++)
      if (args[i] == args[j])
        Py_RETURN_FALSE;
  try {
    for (Py_ssize_t i = 0; i < n; i++)
      if (!matches(expected[i], args[i]))
        Py_RETURN_FALSE;
  } catch (...) {  // sizes a tensor type does not give (a custom sizes policy): no match
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

void release(std::vector<Expected>* expected) {
  for (const Expected& e : *expected)
    Py_DECREF(reinterpret_cast<PyObject*>(e.type));
  delete expected;
}

void guard_dealloc(PyObject* self) {
  release(reinterpret_cast<Guard*>(self)->expected);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject GuardType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* make(PyObject* /*module*/, PyObject* const* args, Py_ssize_t n) {
  auto* expected = new std::vector<Expected>();
  try {
    for (Py_ssize_t i = 0; i < n; i++) {
      if (!THPVariable_Check(args[i])) {
        release(expected);
        PyErr_Format(PyExc_TypeError, "make: argument %zd is a %s, not a tensor", i, Py_TYPE(args[i])->tp_name);
        return nullptr;
      }
      c10::TensorImpl* impl = THPVariable_Unpack(args[i]).unsafeGetTensorImpl();
      if (impl->has_symbolic_sizes_strides()) {
        release(expected);
        PyErr_SetString(PyExc_TypeError, "make: a tensor with symbolic sizes");
        return nullptr;
      }
      Expected e{Py_TYPE(args[i]), impl->key_set().raw_repr(), impl->dtype().toScalarType(), impl->device(),
                 impl->requires_grad(), impl->sizes().vec(), impl->strides().vec()};
      Py_INCREF(reinterpret_cast<PyObject*>(e.type));
      expected->push_back(std::move(e));
    }
  } catch (const std::exception& exc) {
    release(expected);
    PyErr_Format(PyExc_TypeError, "make: %s", exc.what());
    return nullptr;
  }
  Guard* guard = PyObject_New(Guard, &GuardType);
  if (guard == nullptr) {
    release(expected);
    return nullptr;
  }
  guard->vectorcall = guard_call;
  guard->expected = expected;
  return reinterpret_cast<PyObject*>(guard);
}

PyMethodDef methods[] = {
    {"make", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make)), METH_FASTCALL,
     "make(*tensors): a guard, called with as many objects, True when they match the tensors' signature"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, nullptr, nullptr, -1, methods};

}  // namespace

// The module's name is the build's (graft/tensor_guard.py keys it by source and torch):
// TORCH_EXTENSION_NAME is defined by torch.utils.cpp_extension.
#define GRAFT_CONCAT2(a, b) a##b
#define GRAFT_CONCAT(a, b) GRAFT_CONCAT2(a, b)
#define GRAFT_STR2(x) #x
#define GRAFT_STR(x) GRAFT_STR2(x)
PyMODINIT_FUNC GRAFT_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  GuardType.tp_name = "graft.TensorGuard";
  GuardType.tp_basicsize = sizeof(Guard);
  GuardType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  GuardType.tp_vectorcall_offset = offsetof(Guard, vectorcall);
  GuardType.tp_call = PyVectorcall_Call;
  GuardType.tp_dealloc = guard_dealloc;
  if (PyType_Ready(&GuardType) < 0)
    return nullptr;
  module.m_name = GRAFT_STR(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module);
}
