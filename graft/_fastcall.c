/* graft._fastcall: dispatch's hot path for a remembered argument signature, in C.
 *
 * call(op, *args, **kwargs) and run(op, *args, **kwargs) do what graft.dispatch's Python
 * entries do when the arguments have a signature that already passed the op's validation
 * and one implementation serves it unconditionally: find the signature among the op's
 * remembered ones, call the implementation, return its result (run: with the
 * implementation). Anything else (no remembered signature matches, the implementation
 * raises GraftUnsupportedError) goes to the Python code, which is the definition; this
 * file only saves the Python frames and the argument tuples and dicts around the call.
 *
 * A remembered signature ("hit") is a tuple built by graft.signature.Recogniser.fast_hit:
 *   (nargs, kwnames, kinds, guard, values, varying, varying_at, context, context_value, impl, fn)
 * nargs     positional arguments after op; kwnames: the keyword names, in call order (a
 *           call matches only with the same shape: other spellings get their own hit)
 * kinds     bytes, one per passed argument: T tensor, G tensor the guard alone checks, N
 *           None, S scalar (exact type and value), V varying scalar (exact type; values
 *           checked by `varying`)
 * guard     called with the T and G arguments in order: True when their metadata match (a T
 *           argument's is_nested must be False first: torch's check aborts on a nested tensor;
 *           graft's own guard, graft/_tensor_guard.cpp, compares each object's type and key
 *           set before anything else, so a G argument goes to it as it is)
 * values    tuple of (type, value), one per S argument in order
 * varying   None, or called with the arguments at the positions in varying_at
 * context   None, or called with no arguments: must return the object context_value, a
 *           weak reference, refers to (identity; a dead reference matches nothing)
 * impl      the Implementation that serves (returned by run, handed to fall_back)
 * fn        impl.fn, the function called (Implementation is frozen: read once, when the
 *           signature is remembered; a Python attribute read per call costs an instance-dict
 *           and a type lookup, which the kernels between two calls push out of the caches)
 *
 * int_bounds(t) and int_steps(t) serve the value checks a remembered signature still runs
 * (OpSpec.check_values): the smallest and largest value of an index tensor (block tables,
 * positions, expert ids), or the first, last, smallest and largest step of a cumulative one
 * (cu_seqlens), read in one C loop where torch ops and .item()/.tolist() cost microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_ARGS 32

static PyObject *table;         /* op -> list of hits */
static PyObject *slow_call;     /* the Python entries: every case this file does not take */
static PyObject *slow_run;
static PyObject *fall_back;     /* fall_back(op, impl, exc, args, kwargs) -> (out, impl) */
static PyObject *unsupported;   /* GraftUnsupportedError */
static PyObject *compiler;      /* torch.compiler's __dict__ (its _is_compiling_flag), or None: a module
                                  attribute read goes through the module type's lookup first */
static PyObject *str_flag, *str_is_nested;
static PyObject *tensor_type, *int32_dtype, *int64_dtype;  /* int_bounds: set by configure_bounds */
static PyObject *str_is_cpu, *str_dtype, *str_is_contiguous, *str_numel, *str_data_ptr;

static int
matches(PyObject *hit, PyObject *const *args, Py_ssize_t n, Py_ssize_t nargs, PyObject *kwnames)
{
    /* 1: the call has this hit's signature, 0: not, -1: error (raised by varying/context). */
    Py_ssize_t hit_nargs = PyLong_AsSsize_t(PyTuple_GET_ITEM(hit, 0));
    if (hit_nargs != nargs)
        return 0;
    PyObject *hit_kw = PyTuple_GET_ITEM(hit, 1);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (PyTuple_GET_SIZE(hit_kw) != nkw)
        return 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *a = PyTuple_GET_ITEM(hit_kw, i), *b = PyTuple_GET_ITEM(kwnames, i);
        if (a != b) {
            int eq = PyObject_RichCompareBool(a, b, Py_EQ);
            if (eq <= 0)
                return eq;
        }
    }
    const char *kinds = PyBytes_AS_STRING(PyTuple_GET_ITEM(hit, 2));
    PyObject *values = PyTuple_GET_ITEM(hit, 4);
    PyObject *tensors[MAX_ARGS];
    Py_ssize_t nt = 0, nv = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = args[i];
        switch (kinds[i]) {
        case 'T': {
            /* torch's C++ check throws on a nested tensor where Python cannot catch it (an
             * abort): ask first. Anything without the attribute is no tensor: no match. */
            PyObject *nested = PyObject_GetAttr(a, str_is_nested);
            if (nested == NULL) {
                PyErr_Clear();
                return 0;
            }
            Py_DECREF(nested);
            if (nested != Py_False)
                return 0;
            tensors[nt++] = a;
            break;
        }
        case 'G':
            tensors[nt++] = a;
            break;
        case 'N':
            if (a != Py_None)
                return 0;
            break;
        case 'S': {
            PyObject *pair = PyTuple_GET_ITEM(values, nv++);
            PyObject *want = PyTuple_GET_ITEM(pair, 1);
            if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(pair, 0))
                return 0;
            if (a != want) {
                int eq = PyObject_RichCompareBool(a, want, Py_EQ);
                if (eq <= 0)
                    return eq;
            }
            break;
        }
        case 'V': {
            PyObject *pair = PyTuple_GET_ITEM(values, nv++);
            if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(pair, 0))
                return 0;
            break;
        }
        default:
            return 0;
        }
    }
    if (nt) {
        PyObject *ok = PyObject_Vectorcall(PyTuple_GET_ITEM(hit, 3), tensors, nt, NULL);
        if (ok == NULL)
            return -1;
        int yes = ok == Py_True;
        Py_DECREF(ok);
        if (!yes)
            return 0;
    }
    PyObject *context = PyTuple_GET_ITEM(hit, 7);
    if (context != Py_None) {
        PyObject *got = PyObject_CallNoArgs(context);
        if (got == NULL)
            return -1;
        PyObject *want = PyTuple_GET_ITEM(hit, 8);  /* a weakref.ref: the group is not kept alive */
        if (PyWeakref_Check(want))
            want = PyWeakref_GET_OBJECT(want);  /* borrowed; Py_None once dead */
        int same = got == want && want != Py_None;
        Py_DECREF(got);
        if (!same)
            return 0;
    }
    PyObject *varying = PyTuple_GET_ITEM(hit, 5);
    if (varying != Py_None) {
        PyObject *at = PyTuple_GET_ITEM(hit, 6);
        Py_ssize_t m = PyTuple_GET_SIZE(at);
        PyObject *picked[MAX_ARGS];
        for (Py_ssize_t j = 0; j < m; j++)
            picked[j] = args[PyLong_AsSsize_t(PyTuple_GET_ITEM(at, j))];
        PyObject *r = PyObject_Vectorcall(varying, picked, m, NULL);  /* raises as the validator would */
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 1;
}

static PyObject *
fall_back_after(PyObject *op, PyObject *impl, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    /* impl raised GraftUnsupportedError: hand it to dispatch._fall_back with a tuple and a dict. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *tuple = PyTuple_New(nargs), *kwargs = PyDict_New(), *result = NULL;
    if (tuple == NULL || kwargs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
            goto done;
    result = PyObject_CallFunctionObjArgs(fall_back, op, impl, value, tuple, kwargs, NULL);
done:
    Py_XDECREF(tuple);
    Py_XDECREF(kwargs);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return result;  /* (out, impl) */
}

static PyObject *
entry(PyObject *const *args, size_t nargsf, PyObject *kwnames, int with_impl)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *slow = with_impl ? slow_run : slow_call;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < 1 || nargs - 1 + nkw > MAX_ARGS)
        return PyObject_Vectorcall(slow, args, nargsf, kwnames);
    PyObject *hits = PyDict_GetItemWithError(table, args[0]);  /* borrowed */
    if (hits == NULL) {
        if (PyErr_Occurred())
            PyErr_Clear();  /* an unhashable op name: the Python entry names the problem */
        return PyObject_Vectorcall(slow, args, nargsf, kwnames);
    }
    if (compiler != Py_None) {  /* torch.compile/export running Python for real: the Python entries */
        PyObject *flag = PyDict_GetItemWithError(compiler, str_flag);  /* borrowed */
        if (flag == NULL)
            PyErr_Clear();
        else if (flag == Py_True)
            return PyObject_Vectorcall(slow, args, nargsf, kwnames);
    }
    PyObject *impl = NULL, *fn = NULL;
    Py_INCREF(hits);  /* the list may be replaced while a hit runs Python code */
    for (Py_ssize_t h = 0; h < PyList_GET_SIZE(hits); h++) {
        PyObject *hit = PyList_GET_ITEM(hits, h);
        Py_INCREF(hit);
        int m = matches(hit, args + 1, nargs - 1 + nkw, nargs - 1, kwnames);
        if (m == 1) {
            impl = PyTuple_GET_ITEM(hit, 9);
            fn = PyTuple_GET_ITEM(hit, 10);
            Py_INCREF(impl);
            Py_INCREF(fn);
        }
        Py_DECREF(hit);
        if (m < 0) {
            Py_DECREF(hits);
            return NULL;
        }
        if (m == 1)
            break;
    }
    Py_DECREF(hits);
    if (impl == NULL)
        return PyObject_Vectorcall(slow, args, nargsf, kwnames);
    PyObject *out = PyObject_Vectorcall(fn, args + 1, nargs - 1, kwnames);
    Py_DECREF(fn);
    if (out == NULL) {
        PyObject *pair = NULL;
        if (PyErr_ExceptionMatches(unsupported))
            pair = fall_back_after(args[0], impl, args + 1, nargs - 1, kwnames);
        Py_DECREF(impl);
        if (pair == NULL || with_impl)
            return pair;
        PyObject *first = PyTuple_GetItem(pair, 0);
        Py_XINCREF(first);
        Py_DECREF(pair);
        return first;
    }
    if (!with_impl) {
        Py_DECREF(impl);
        return out;
    }
    PyObject *pair = PyTuple_Pack(2, out, impl);
    Py_DECREF(out);
    Py_DECREF(impl);
    return pair;
}

static PyObject *
fast_call(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    return entry(args, (size_t)nargsf, kwnames, 0);
}

static PyObject *
fast_run(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    return entry(args, (size_t)nargsf, kwnames, 1);
}

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *t, *sc, *sr, *fb, *exc, *comp;
    if (!PyArg_ParseTuple(args, "O!OOOOO:configure", &PyDict_Type, &t, &sc, &sr, &fb, &exc, &comp))
        return NULL;
    Py_XSETREF(table, Py_NewRef(t));
    Py_XSETREF(slow_call, Py_NewRef(sc));
    Py_XSETREF(slow_run, Py_NewRef(sr));
    Py_XSETREF(fall_back, Py_NewRef(fb));
    Py_XSETREF(unsupported, Py_NewRef(exc));
    if (comp != Py_None && !PyDict_Check(comp)) {
        PyErr_SetString(PyExc_TypeError, "configure: the compiler flag's namespace must be a dict or None");
        return NULL;
    }
    Py_XSETREF(compiler, Py_NewRef(comp));
    Py_RETURN_NONE;
}

static PyObject *
configure_bounds(PyObject *self, PyObject *args)
{
    PyObject *tt, *i32, *i64;
    if (!PyArg_ParseTuple(args, "O!OO:configure_bounds", &PyType_Type, &tt, &i32, &i64))
        return NULL;
    Py_XSETREF(tensor_type, Py_NewRef(tt));
    Py_XSETREF(int32_dtype, Py_NewRef(i32));
    Py_XSETREF(int64_dtype, Py_NewRef(i64));
    Py_RETURN_NONE;
}

/* A no-argument method's result as a C long long (-1 with an error set on failure). */
static long long
call_as_long(PyObject *obj, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return v;
}

/* A plain, contiguous, non-empty CPU int32/int64 torch.Tensor's data: 1 and (*data, *n, *wide)
 * set; 0 for anything else (the caller then asks torch); -1 with an error set. Only exact
 * torch.Tensor: a subclass's storage may be elsewhere or absent. */
static int
index_data(PyObject *t, const void **data, long long *n, int *wide)
{
    if (tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)tensor_type)
        return 0;
    PyObject *flag = PyObject_GetAttr(t, str_is_cpu);
    if (flag == NULL)
        return -1;
    int cpu = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (cpu <= 0)
        return cpu;
    PyObject *dtype = PyObject_GetAttr(t, str_dtype);
    if (dtype == NULL)
        return -1;
    *wide = dtype == int64_dtype;
    int narrow = dtype == int32_dtype;
    Py_DECREF(dtype);
    if (!*wide && !narrow)
        return 0;
    PyObject *contiguous = PyObject_CallMethodNoArgs(t, str_is_contiguous);
    if (contiguous == NULL)
        return -1;
    int dense = PyObject_IsTrue(contiguous);
    Py_DECREF(contiguous);
    if (dense <= 0)
        return dense;
    *n = call_as_long(t, str_numel);
    if (*n < 0 && PyErr_Occurred())
        return -1;
    long long address = call_as_long(t, str_data_ptr);
    if (address == -1 && PyErr_Occurred())
        return -1;
    if (*n <= 0 || address == 0)
        return 0;
    *data = (const void *)(uintptr_t)address;
    return 1;
}

static inline long long
value_at(const void *data, int wide, long long i)
{
    return wide ? ((const int64_t *)data)[i] : ((const int32_t *)data)[i];
}

static PyObject *
int_bounds(PyObject *self, PyObject *t)
{
    const void *data;
    long long n;
    int wide;
    int ok = index_data(t, &data, &n, &wide);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    long long lo = value_at(data, wide, 0), hi = lo;
    for (long long i = 1; i < n; i++) {
        long long v = value_at(data, wide, i);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    return Py_BuildValue("(LL)", lo, hi);
}

static PyObject *
int_steps(PyObject *self, PyObject *t)
{
    /* (first, last, smallest step, largest step) of a cumulative index tensor (cu_seqlens),
     * read as int_bounds reads it; steps are 0 for a single element. */
    const void *data;
    long long n;
    int wide;
    int ok = index_data(t, &data, &n, &wide);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    long long prev = value_at(data, wide, 0), lo = 0, hi = 0;
    for (long long i = 1; i < n; i++) {
        long long cur = value_at(data, wide, i), step = cur - prev;
        if (i == 1 || step < lo)
            lo = step;
        if (i == 1 || step > hi)
            hi = step;
        prev = cur;
    }
    return Py_BuildValue("(LLLL)", value_at(data, wide, 0), prev, lo, hi);
}

static PyMethodDef methods[] = {
    {"configure_bounds", configure_bounds, METH_VARARGS,
     "configure_bounds(tensor_type, int32, int64): set once by graft.ops._validate"},
    {"int_bounds", int_bounds, METH_O,
     "int_bounds(t): (min, max) of a contiguous CPU int32/int64 torch.Tensor, else None"},
    {"int_steps", int_steps, METH_O,
     "int_steps(t): (first, last, min step, max step) of a contiguous CPU int32/int64 torch.Tensor, else None"},
    {"configure", configure, METH_VARARGS,
     "configure(table, slow_call, slow_run, fall_back, unsupported_error, torch_compiler): set once by graft.dispatch"},
    {"call", (PyCFunction)(void (*)(void))fast_call, METH_FASTCALL | METH_KEYWORDS,
     "call(op, *args, **kwargs): graft.dispatch.call"},
    {"run", (PyCFunction)(void (*)(void))fast_run, METH_FASTCALL | METH_KEYWORDS,
     "run(op, *args, **kwargs): graft.dispatch.run"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "graft._fastcall", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__fastcall(void)
{
    str_flag = PyUnicode_InternFromString("_is_compiling_flag");
    str_is_nested = PyUnicode_InternFromString("is_nested");
    str_is_cpu = PyUnicode_InternFromString("is_cpu");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    str_numel = PyUnicode_InternFromString("numel");
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    if (str_flag == NULL || str_is_nested == NULL || str_is_cpu == NULL || str_dtype == NULL
        || str_is_contiguous == NULL || str_numel == NULL || str_data_ptr == NULL)
        return NULL;
    return PyModule_Create(&module);
}
