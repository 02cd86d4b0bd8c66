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
#include <new>
#include <vector>

namespace {

// What one tensor must have. A guard keeps these, and then every tensor's sizes and strides,
// inside its own Python object: one allocation the call reads front to back. Between two
// calls of an op the kernels run, and on the real call what graft reads is mostly out of the
// caches; with a vector of these, each holding its own two vectors, a 7-tensor guard's
// fields were spread over about 24 cache lines, and are on about 9 adjacent ones now.
struct Expected {
  PyTypeObject* type;  // a strong reference: a freed subclass's address must not match a new type
  uint64_t keys;
  c10::Device device;
  c10::ScalarType dtype;
  bool requires_grad;
  int32_t ndim;  // sizes at dims + offset, strides right after them
  int32_t offset;
};

struct Guard {
  PyObject_VAR_HEAD  // ob_size: bytes of data
  vectorcallfunc vectorcall;
  Py_ssize_t n;
  alignas(8) char data[];  // Expected[n], then int64_t dims[]
};

Expected* entries(Guard* g) {
  return reinterpret_cast<Expected*>(g->data);
}

const int64_t* dims(Guard* g) {
  return reinterpret_cast<const int64_t*>(g->data + g->n * sizeof(Expected));
}

bool matches(const Expected& e, const int64_t* want, PyObject* obj) {
  if (Py_TYPE(obj) != e.type)
    return false;
  c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (impl->key_set().raw_repr() != e.keys || impl->dtype().toScalarType() != e.dtype ||
      impl->device() != e.device || impl->requires_grad() != e.requires_grad)
    return false;
  if (impl->has_symbolic_sizes_strides())
    return false;
  c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  if (static_cast<int64_t>(sizes.size()) != e.ndim)
    return false;
  for (int32_t d = 0; d < e.ndim; d++)
    if (sizes[d] != want[d] || strides[d] != want[e.ndim + d])
      return false;
  return true;
}

PyObject* guard_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Guard* g = reinterpret_cast<Guard*>(self);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || n != g->n)
    Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; i++)
    for (Py_ssize_t j = 0; j < i; j++)
      if (args[i] == args[j])
        Py_RETURN_FALSE;
  const Expected* expected = entries(g);
  const int64_t* want = dims(g);
  try {
    for (Py_ssize_t i = 0; i < n; i++)
      if (!matches(expected[i], want + expected[i].offset, args[i]))
        Py_RETURN_FALSE;
  } catch (...) {  // sizes a tensor type does not give (a custom sizes policy): no match
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

void guard_dealloc(PyObject* self) {
  Guard* g = reinterpret_cast<Guard*>(self);
  for (Py_ssize_t i = 0; i < g->n; i++)
    Py_XDECREF(reinterpret_cast<PyObject*>(entries(g)[i].type));
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject GuardType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* make(PyObject* /*module*/, PyObject* const* args, Py_ssize_t n) {
  // First every check (a non-tensor, symbolic sizes) and the size of the block; then the block.
  std::vector<c10::TensorImpl*> impls;
  Py_ssize_t ndims = 0;
  try {
    for (Py_ssize_t i = 0; i < n; i++) {
      if (!THPVariable_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "make: argument %zd is a %s, not a tensor", i, Py_TYPE(args[i])->tp_name);
        return nullptr;
      }
      c10::TensorImpl* impl = THPVariable_Unpack(args[i]).unsafeGetTensorImpl();
      if (impl->has_symbolic_sizes_strides()) {
        PyErr_SetString(PyExc_TypeError, "make: a tensor with symbolic sizes");
        return nullptr;
      }
      ndims += static_cast<Py_ssize_t>(impl->sizes().size()) + static_cast<Py_ssize_t>(impl->strides().size());
      impls.push_back(impl);
    }
  } catch (const std::exception& exc) {
    PyErr_Format(PyExc_TypeError, "make: %s", exc.what());
    return nullptr;
  }
  Py_ssize_t bytes = n * static_cast<Py_ssize_t>(sizeof(Expected)) + ndims * static_cast<Py_ssize_t>(sizeof(int64_t));
  Guard* g = PyObject_NewVar(Guard, &GuardType, bytes);
  if (g == nullptr)
    return nullptr;
  g->vectorcall = guard_call;
  g->n = 0;  // counts the entries filled: dealloc releases those
  int64_t* out = const_cast<int64_t*>(reinterpret_cast<const int64_t*>(g->data + n * sizeof(Expected)));
  int32_t offset = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    c10::TensorImpl* impl = impls[i];
    c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
    int32_t ndim = static_cast<int32_t>(sizes.size());
    Py_INCREF(reinterpret_cast<PyObject*>(Py_TYPE(args[i])));
    new (entries(g) + i) Expected{Py_TYPE(args[i]), impl->key_set().raw_repr(), impl->device(),
                                  impl->dtype().toScalarType(), impl->requires_grad(), ndim, offset};
    for (int32_t d = 0; d < ndim; d++) {
      out[offset + d] = sizes[d];
      out[offset + ndim + d] = strides[d];
    }
    offset += 2 * ndim;
    g->n = i + 1;
  }
  return reinterpret_cast<PyObject*>(g);
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
  GuardType.tp_basicsize = offsetof(Guard, data);
  GuardType.tp_itemsize = 1;
  GuardType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  GuardType.tp_vectorcall_offset = offsetof(Guard, vectorcall);
  GuardType.tp_call = PyVectorcall_Call;
  GuardType.tp_dealloc = guard_dealloc;
  if (PyType_Ready(&GuardType) < 0)
    return nullptr;
  module.m_name = GRAFT_STR(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module);
}
