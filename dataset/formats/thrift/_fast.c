/* distlearn.dataset.formats.thrift._fast: the binary and compact decoders in C.
 *
 *   setup(error, field_schema, element_schema, finish_list, as_string, make_map,
 *         uuid_from_bytes, empty, dtypes)     once, from _native.py
 *   decode(buf, compact, schema, numpy, max_depth, max_objects) -> dict
 *
 * The contract is the pure-Python decoders' (_binary.py, _compact.py): the same
 * value for every record, and a ThriftError (naming an offset) for every record
 * they refuse; tests/test_thrift_native.py holds the two against each other on
 * random and mutated records. Where a record has one fault the message is theirs
 * too; where it has several, the one named may differ (the Python compact decoder
 * decodes a struct's varint containers once the walk is over, this one in order).
 *
 * What Python does per element is done here per element too, but with no
 * interpreter between: numbers become PyLong/PyFloat straight from the bytes, and
 * with numpy=True a container of numbers is written straight into a new array
 * (one np.empty call per container, none per element). What is rare
 * or has Python's own semantics (schemas, "string" as UTF-8, sets, uuid keys)
 * calls the same Python helpers the pure decoders call.
 *
 * Bounds: every count is checked against the bytes that remain before anything
 * is allocated; every value made is charged to the record's budget of
 * max_objects (a struct field, a list or set element, a map key and value each
 * count one; a container read as an array two more, as a pair of arrays four)
 * before it is made; nesting stops at max_depth, and at Python's recursion limit
 * (Py_EnterRecursiveCall), whichever comes first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    STOP = 0, BOOL = 2, BYTE = 3, DOUBLE = 4, I16 = 6, I32 = 8, I64 = 10,
    STRING = 11, STRUCT = 12, MAP = 13, SET = 14, LIST = 15, UUID = 16, NTYPES = 17
};

static const char *NAME[NTYPES] = {
    [BOOL] = "bool", [BYTE] = "byte", [DOUBLE] = "double", [I16] = "i16", [I32] = "i32",
    [I64] = "i64", [STRING] = "binary", [STRUCT] = "struct", [MAP] = "map", [SET] = "set",
    [LIST] = "list", [UUID] = "uuid",
};
/* Fixed-width numbers: their width in the binary protocol and as an array's item. */
static const int WIDTH[NTYPES] = {
    [BOOL] = 1, [BYTE] = 1, [I16] = 2, [I32] = 4, [I64] = 8, [DOUBLE] = 8,
};
/* The fewest bytes one element takes (0: not an element type): what counts are checked
 * against. As _binary.MIN_SIZE and _compact.MIN_SIZE. */
static const int B_MIN[NTYPES] = {
    [BOOL] = 1, [BYTE] = 1, [I16] = 2, [I32] = 4, [I64] = 8, [DOUBLE] = 8, [STRING] = 4,
    [STRUCT] = 1, [MAP] = 6, [SET] = 5, [LIST] = 5, [UUID] = 16,
};
static const int C_MIN[NTYPES] = {
    [BOOL] = 1, [BYTE] = 1, [I16] = 1, [I32] = 1, [I64] = 1, [DOUBLE] = 8, [STRING] = 1,
    [STRUCT] = 1, [MAP] = 1, [SET] = 1, [LIST] = 1, [UUID] = 16,
};
/* compact type nibble -> type id; -1: none (1 and 2 are a bool field's value, or bool) */
static const int C_TYPE[16] = {
    -1, BOOL, BOOL, BYTE, I16, I32, I64, DOUBLE, STRING, LIST, SET, MAP, STRUCT, UUID, -1, -1,
};
#define VECTOR_MIN 16 /* _compact.VECTOR_MIN: which of its paths (and messages) Python takes */

static PyObject *ThriftError, *h_field_schema, *h_element_schema, *h_finish_list,
    *h_as_string, *h_make_map, *h_uuid, *h_empty, *dtypes[NTYPES];

typedef struct {
    const uint8_t *b;
    Py_ssize_t end;
    Py_ssize_t left; /* objects the budget still allows */
    Py_ssize_t max_objects;
    int numpy;
} R;

/* ------------------------------------------------------------------ errors */

static PyObject *truncated(Py_ssize_t pos, const char *what) {
    PyErr_Format(ThriftError, "truncated: %s at offset %zd runs past the end", what, pos);
    return NULL;
}

static PyObject *too_deep(Py_ssize_t pos) {
    PyErr_Format(ThriftError, "nesting too deep at offset %zd (limit max_depth)", pos);
    return NULL;
}

/* n more objects, or ThriftError naming the budget. */
static inline int charge(R *r, Py_ssize_t n, Py_ssize_t pos) {
    if (n <= r->left) {
        r->left -= n;
        return 0;
    }
    PyErr_Format(ThriftError, "more than %zd objects by offset %zd (limit max_objects)",
                 r->max_objects, pos);
    return -1;
}

/* Why a binary container's count at pos (its elements start there) is refused. */
static PyObject *bad_count(R *r, Py_ssize_t pos, long long n, const char *kind, int kt, int vt) {
    int types[2] = {kt, vt}, k = vt < 0 ? 1 : 2;
    long long need = 0;
    for (int i = 0; i < k; i++) {
        if (types[i] < 0 || types[i] >= NTYPES || !B_MIN[types[i]]) {
            PyErr_Format(ThriftError, "unknown element type id %d of a %s at offset %zd",
                         types[i], kind, pos);
            return NULL;
        }
        need += B_MIN[types[i]];
    }
    char what[64];
    if (k == 1)
        snprintf(what, sizeof what, "%s<%s>", kind, NAME[kt]);
    else
        snprintf(what, sizeof what, "%s<%s, %s>", kind, NAME[kt], NAME[vt]);
    if (n < 0) {
        PyErr_Format(ThriftError, "negative size %lld of a %s at offset %zd", n, what, pos);
        return NULL;
    }
    Py_ssize_t remain = r->end - pos > 0 ? r->end - pos : 0;
    PyErr_Format(ThriftError, "a %s of %lld elements at offset %zd needs at least %lld bytes; "
                 "%zd remain", what, n, pos, n * need, remain);
    return NULL;
}

/* The compact protocol's count check (_compact._check_count): n elements of a list<kt>
 * (vt < 0) or entries of a map<kt, vt> at pos must fit in the bytes that remain. */
static int check_count(R *r, Py_ssize_t pos, long long n, int kt, int vt) {
    long long size = C_MIN[kt] + (vt < 0 ? 0 : C_MIN[vt]);
    if (n * size <= r->end - pos)
        return 0;
    char what[64];
    if (vt < 0)
        snprintf(what, sizeof what, "list<%s>", NAME[kt]);
    else
        snprintf(what, sizeof what, "map<%s, %s>", NAME[kt], NAME[vt]);
    Py_ssize_t remain = r->end - pos > 0 ? r->end - pos : 0;
    PyErr_Format(ThriftError, "a %s of %lld elements at offset %zd needs at least %lld bytes; "
                 "%zd remain", what, n, pos, n * size, remain);
    return -1;
}

/* ------------------------------------------------------------------ helpers */

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* one load each (the byte-by-byte forms below are not always merged into one) */
static inline uint32_t be32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}
static inline uint64_t be64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
}
static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
#else
static inline uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }
static inline uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
#endif
static inline double as_double(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* A struct's schema for field fid of wire type t: None where there is no schema. */
static PyObject *field_schema(PyObject *sch, int fid, int t) {
    if (sch == Py_None)
        return Py_NewRef(Py_None);
    return PyObject_CallFunction(h_field_schema, "Oii", sch, fid, t);
}

static PyObject *element_schema(PyObject *sch, int t, int which) {
    if (sch == Py_None)
        return Py_NewRef(Py_None);
    return PyObject_CallFunction(h_element_schema, "Oii", sch, t, which);
}

/* A decoded list (its elements start at pos): a set where the schema says ("set", T).
 * Steals items. */
static PyObject *finish_list(PyObject *items, PyObject *sch, Py_ssize_t pos) {
    if (items == NULL || sch == Py_None)
        return items;
    PyObject *v = PyObject_CallFunction(h_finish_list, "OOn", items, sch, pos);
    Py_DECREF(items);
    return v;
}

static int is_string_schema(PyObject *sch) {
    return sch != Py_None && PyUnicode_Check(sch) &&
           PyUnicode_CompareWithASCIIString(sch, "string") == 0;
}

/* n bytes at p as bytes, or as str (ThriftError naming pos if not UTF-8) for "string". */
static PyObject *string(const uint8_t *p, Py_ssize_t n, Py_ssize_t pos, PyObject *sch) {
    PyObject *raw = PyBytes_FromStringAndSize((const char *)p, n);
    if (raw == NULL || !is_string_schema(sch))
        return raw;
    PyObject *v = PyObject_CallFunction(h_as_string, "On", raw, pos);
    Py_DECREF(raw);
    return v;
}

static PyObject *uuid_at(const uint8_t *p) {
    PyObject *raw = PyBytes_FromStringAndSize((const char *)p, 16);
    if (raw == NULL)
        return NULL;
    PyObject *v = PyObject_CallOneArg(h_uuid, raw);
    Py_DECREF(raw);
    return v;
}

/* A new array of n items of type t (np.empty); *data is where they go. An array whose
 * memory numpy allocates costs about a quarter of one over a bytearray (np.frombuffer
 * keeps a memoryview and the bytearray beside it: 488 bytes for an empty one). */
static PyObject *new_array(int t, Py_ssize_t n, char **data) {
    PyObject *len = PyLong_FromSsize_t(n);
    PyObject *a = len ? PyObject_CallFunctionObjArgs(h_empty, len, dtypes[t], NULL) : NULL;
    Py_XDECREF(len);
    if (a == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(a, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    *data = view.buf; /* an array's memory stays where it is while the array lives */
    PyBuffer_Release(&view);
    return a;
}

static PyObject *pair(PyObject *a, PyObject *b) {
    if (a == NULL || b == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    PyObject *t = PyTuple_Pack(2, a, b);
    Py_DECREF(a);
    Py_DECREF(b);
    return t;
}

static PyObject *new_dict(Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_NewPresized(n); /* a map's size is known: no resize on the way */
#else
    (void)n;
    return PyDict_New();
#endif
}

static int set_item(PyObject *d, PyObject *k, PyObject *v) {
    if (k == NULL || v == NULL) {
        Py_XDECREF(k);
        Py_XDECREF(v);
        return -1;
    }
    int rc = PyDict_SetItem(d, k, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return rc;
}

/* A map from its keys and values (lists): a dict; for container keys (never hashable:
 * dicts, lists, sets, arrays) a list of (key, value) pairs; for uuid keys what
 * _wire.make_map makes (it refuses keys crafted to share a hash). As _wire.make_map. */
static PyObject *make_map(PyObject *keys, PyObject *vals, int kt, Py_ssize_t pos) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n && kt == UUID)
        return PyObject_CallFunction(h_make_map, "OOn", keys, vals, pos);
    if (n && (kt == STRUCT || kt == MAP || kt == SET || kt == LIST)) {
        PyObject *out = PyList_New(n);
        for (Py_ssize_t i = 0; out && i < n; i++) {
            PyObject *t = PyTuple_Pack(2, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(vals, i));
            if (t == NULL)
                Py_CLEAR(out);
            else
                PyList_SET_ITEM(out, i, t);
        }
        return out;
    }
    PyObject *d = new_dict(n);
    for (Py_ssize_t i = 0; d && i < n; i++)
        if (PyDict_SetItem(d, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(vals, i)) < 0)
            Py_CLEAR(d);
    return d;
}

/* ------------------------------------------------------------------ binary */

static PyObject *b_value(R *r, Py_ssize_t *pp, int t, int depth, PyObject *sch);

static PyObject *b_struct(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp;
    if (depth <= 0)
        return too_deep(pos);
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    const uint8_t *b = r->b;
    PyObject *out = PyDict_New();
    while (out != NULL) {
        if (pos >= r->end) {
            truncated(pos, "a struct field");
            goto fail;
        }
        int t = b[pos];
        if (t == STOP) {
            *pp = pos + 1;
            break;
        }
        if (r->end - pos < 3) {
            truncated(pos, "a struct field");
            goto fail;
        }
        int fid = (int16_t)be16(b + pos + 1);
        if (t >= NTYPES || !B_MIN[t]) {
            PyErr_Format(ThriftError, "unknown type id %d of field %d at offset %zd", t, fid, pos);
            goto fail;
        }
        if (charge(r, 1, pos))
            goto fail;
        PyObject *sub = field_schema(sch, fid, t);
        if (sub == NULL)
            goto fail;
        Py_ssize_t p = pos + 3;
        PyObject *v = b_value(r, &p, t, depth - 1, sub);
        Py_DECREF(sub);
        if (v == NULL || set_item(out, PyLong_FromLong(fid), v) < 0)
            goto fail;
        pos = p;
    }
    Py_LeaveRecursiveCall();
    return out;
fail:
    Py_LeaveRecursiveCall();
    Py_XDECREF(out);
    return NULL;
}

/* One fixed-width number at p as a Python object. */
static PyObject *b_number(const uint8_t *p, int t) {
    switch (t) {
    case BOOL:
        return PyBool_FromLong(p[0] != 0);
    case BYTE:
        return PyLong_FromLong((int8_t)p[0]);
    case I16:
        return PyLong_FromLong((int16_t)be16(p));
    case I32:
        return PyLong_FromLong((int32_t)be32(p));
    case I64:
        return PyLong_FromLongLong((int64_t)be64(p));
    default: /* DOUBLE */
        return PyFloat_FromDouble(as_double(be64(p)));
    }
}

/* n big-endian numbers of type t at p, into an array's native items at out. */
static void b_fill(char *out, const uint8_t *p, int t, Py_ssize_t n) {
    Py_ssize_t i;
    switch (t) {
    case BOOL:
        for (i = 0; i < n; i++)
            out[i] = p[i] != 0;
        break;
    case BYTE:
        memcpy(out, p, n);
        break;
    case I16:
        for (i = 0; i < n; i++) {
            int16_t v = (int16_t)be16(p + 2 * i);
            memcpy(out + 2 * i, &v, 2);
        }
        break;
    case I32:
        for (i = 0; i < n; i++) {
            int32_t v = (int32_t)be32(p + 4 * i);
            memcpy(out + 4 * i, &v, 4);
        }
        break;
    default: /* I64, DOUBLE: the same 8 bytes reversed */
        for (i = 0; i < n; i++) {
            uint64_t v = be64(p + 8 * i);
            memcpy(out + 8 * i, &v, 8);
        }
    }
}

static PyObject *b_array(const uint8_t *p, int t, Py_ssize_t n) {
    char *data;
    PyObject *a = new_array(t, n, &data);
    if (a != NULL)
        b_fill(data, p, t, n);
    return a;
}

static PyObject *b_list(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp;
    if (depth <= 0)
        return too_deep(pos);
    if (r->end - pos < 5)
        return truncated(pos, "a list header");
    const uint8_t *b = r->b;
    int et = b[pos];
    long long n = (int32_t)be32(b + pos + 1);
    Py_ssize_t start = pos + 5;
    int size = et < NTYPES ? B_MIN[et] : 0;
    if (!size || n < 0 || n * size > r->end - start)
        return bad_count(r, start, n, "list", et, -1);
    int w = WIDTH[et];
    if (w) {
        PyObject *items;
        if (r->numpy) {
            if (charge(r, 1, start))
                return NULL;
            items = b_array(b + start, et, n);
        } else {
            if (charge(r, n, start))
                return NULL;
            items = PyList_New(n);
            for (Py_ssize_t i = 0; items && i < n; i++) {
                PyObject *v = b_number(b + start + i * w, et);
                if (v == NULL)
                    Py_CLEAR(items);
                else
                    PyList_SET_ITEM(items, i, v);
            }
        }
        *pp = start + n * w;
        return finish_list(items, sch, start);
    }
    if (charge(r, n, start))
        return NULL;
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    PyObject *esch = element_schema(sch, et, 1);
    PyObject *items = esch ? PyList_New(n) : NULL;
    Py_ssize_t p = start;
    for (Py_ssize_t i = 0; items && i < n; i++) {
        PyObject *v = b_value(r, &p, et, depth - 1, esch);
        if (v == NULL)
            Py_CLEAR(items);
        else
            PyList_SET_ITEM(items, i, v);
    }
    Py_XDECREF(esch);
    Py_LeaveRecursiveCall();
    *pp = p;
    return finish_list(items, sch, start);
}

static PyObject *b_map(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp;
    if (depth <= 0)
        return too_deep(pos);
    if (r->end - pos < 6)
        return truncated(pos, "a map header");
    const uint8_t *b = r->b;
    int kt = b[pos], vt = b[pos + 1];
    long long n = (int32_t)be32(b + pos + 2);
    Py_ssize_t start = pos + 6;
    int kw = kt < NTYPES ? WIDTH[kt] : 0, vw = vt < NTYPES ? WIDTH[vt] : 0;
    if (kw && vw) { /* the hot path: numbers to numbers */
        if (n < 0 || n * (kw + vw) > r->end - start)
            return bad_count(r, start, n, "map", kt, vt);
        Py_ssize_t step = kw + vw;
        *pp = start + n * step;
        if (r->numpy) {
            char *kd, *vd;
            if (charge(r, 3, start))
                return NULL;
            PyObject *ka = new_array(kt, n, &kd), *va = ka ? new_array(vt, n, &vd) : NULL;
            if (ka && va)
                for (Py_ssize_t i = 0; i < n; i++) {
                    b_fill(kd + i * kw, b + start + i * step, kt, 1);
                    b_fill(vd + i * vw, b + start + i * step + kw, vt, 1);
                }
            return pair(ka, va);
        }
        if (charge(r, 2 * n, start))
            return NULL;
        PyObject *d = new_dict(n);
        for (Py_ssize_t i = 0; d && i < n; i++) {
            const uint8_t *e = b + start + i * step;
            if (set_item(d, b_number(e, kt), b_number(e + kw, vt)) < 0)
                Py_CLEAR(d);
        }
        return d;
    }
    int ks = kt < NTYPES ? B_MIN[kt] : 0, vs = vt < NTYPES ? B_MIN[vt] : 0;
    if (!ks || !vs || n < 0 || n * (ks + vs) > r->end - start)
        return bad_count(r, start, n, "map", kt, vt);
    if (charge(r, 2 * n, start))
        return NULL;
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    PyObject *ksch = element_schema(sch, kt, 1);
    PyObject *vsch = ksch ? element_schema(sch, vt, 2) : NULL;
    PyObject *keys = vsch ? PyList_New(n) : NULL, *vals = keys ? PyList_New(n) : NULL;
    Py_ssize_t p = start;
    for (Py_ssize_t i = 0; vals && i < n; i++) {
        PyObject *k = b_value(r, &p, kt, depth - 1, ksch);
        PyObject *v = k ? b_value(r, &p, vt, depth - 1, vsch) : NULL;
        if (v == NULL) {
            Py_XDECREF(k);
            Py_CLEAR(vals);
            break;
        }
        PyList_SET_ITEM(keys, i, k);
        PyList_SET_ITEM(vals, i, v);
    }
    /* the unset slots of keys are NULL, which list_dealloc skips */
    PyObject *out = vals ? make_map(keys, vals, kt, start) : NULL;
    Py_XDECREF(keys);
    Py_XDECREF(vals);
    Py_XDECREF(ksch);
    Py_XDECREF(vsch);
    Py_LeaveRecursiveCall();
    *pp = p;
    return out;
}

static PyObject *b_value(R *r, Py_ssize_t *pp, int t, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp, left = r->end - pos;
    const uint8_t *p = r->b + pos;
    int w = WIDTH[t];
    if (w) {
        if (left < w)
            return truncated(pos, NAME[t]);
        *pp = pos + w;
        return b_number(p, t);
    }
    switch (t) {
    case STRING: {
        if (left < 4)
            return truncated(pos, "a string length");
        long long n = (int32_t)be32(p);
        if (n < 0 || n > left - 4) {
            PyErr_Format(ThriftError, "string length %lld at offset %zd; %zd bytes remain", n,
                         pos, left - 4);
            return NULL;
        }
        *pp = pos + 4 + n;
        return string(p + 4, n, pos, sch);
    }
    case UUID:
        if (left < 16)
            return truncated(pos, "a uuid");
        *pp = pos + 16;
        return uuid_at(p);
    case STRUCT:
        return b_struct(r, pp, depth, sch);
    case MAP:
        return b_map(r, pp, depth, sch);
    default: /* SET, LIST */
        return b_list(r, pp, depth, sch);
    }
}

/* ------------------------------------------------------------------ compact */

/* The 7-bit groups of a word's bytes (their top bits clear) packed together: pairs, then
 * fours, then eights, each step a shift and two masks. */
static inline uint64_t pack7(uint64_t x) {
    x = (x & 0x007F007F007F007FULL) | ((x >> 1) & 0x3F803F803F803F80ULL);
    x = (x & 0x00003FFF00003FFFULL) | ((x >> 2) & 0x0FFFC0000FFFC000ULL);
    return (x & 0x000000000FFFFFFFULL) | ((x >> 4) & 0x00FFFFFFF0000000ULL);
}

/* An unsigned varint of at most `limit` bytes at *pp, that must fit in `bits` bits
 * (32 or 64): 0, or -1 with ThriftError naming where it starts. */
static inline int uvarint(R *r, Py_ssize_t *pp, int limit, int bits, uint64_t *out) {
    Py_ssize_t pos = *pp, p = pos;
    const uint8_t *b = r->b;
    if (p < r->end && b[p] < 0x80) {
        *out = b[p];
        *pp = p + 1;
        return 0;
    }
#if defined(__GNUC__) || defined(__clang__)
    if (r->end - p >= 10) { /* a word at a time: no branch per byte */
        uint64_t w = le64(b + p), stop = ~w & 0x8080808080808080ULL, v;
        int n, high = 0; /* the varint's bytes; its 10th byte */
        if (stop) {
            n = (__builtin_ctzll(stop) >> 3) + 1;
            uint64_t bytes = n == 8 ? ~0ULL : (1ULL << (8 * n)) - 1; /* the varint's */
            v = pack7(w & bytes & 0x7F7F7F7F7F7F7F7FULL);
        } else {
            v = pack7(w & 0x7F7F7F7F7F7F7F7FULL);
            uint8_t c9 = b[p + 8];
            if (c9 < 0x80) {
                n = 9;
            } else {
                high = b[p + 9];
                n = high < 0x80 ? 10 : 11;
            }
            v |= (uint64_t)(c9 & 0x7F) << 56 | (uint64_t)(high & 1) << 63;
        }
        if (n > limit) {
            PyErr_Format(ThriftError, "varint at offset %zd is longer than %d bytes", pos, limit);
            return -1;
        }
        if ((bits == 32 && v >> 32) || high > 1) {
            PyErr_Format(ThriftError, "varint at offset %zd overflows %d bits", pos, bits);
            return -1;
        }
        *out = v;
        *pp = p + n;
        return 0;
    }
#endif
    uint64_t v = 0;
    int shift = 0;
    uint8_t c;
    for (;;) {
        if (p >= r->end) {
            truncated(pos, "a varint");
            return -1;
        }
        c = b[p++];
        v |= (uint64_t)(c & 0x7F) << shift;
        if (c < 0x80)
            break;
        shift += 7;
        if (shift >= 7 * limit) {
            PyErr_Format(ThriftError, "varint at offset %zd is longer than %d bytes", pos, limit);
            return -1;
        }
    }
    /* bits 64 and up: what the 10th byte held past its lowest bit */
    if ((bits == 32 && v >> 32) || (shift == 63 && (c & 0x7F) > 1)) {
        PyErr_Format(ThriftError, "varint at offset %zd overflows %d bits", pos, bits);
        return -1;
    }
    *out = v;
    *pp = p;
    return 0;
}

/* A zigzag integer of type t (i16, i32, i64) at *pp. `bits` and `vec` say which of
 * Python's paths the container takes (bits: the overflow check of its varints, 64
 * where a map mixes i64 with a narrower type; vec: its range message), cpos where
 * the container's elements start. */
static inline int c_int(R *r, Py_ssize_t *pp, int t, int bits, int vec, Py_ssize_t cpos,
                        int64_t *out) {
    Py_ssize_t pos = *pp;
    uint64_t u;
    if (uvarint(r, pp, t == I64 ? 10 : 5, bits, &u))
        return -1;
    int64_t v = (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
    if (t != I64) {
        int64_t lo = t == I16 ? -32768 : -2147483648LL;
        if (v < lo || v >= -lo) {
            if (vec)
                PyErr_Format(ThriftError, "%s out of range in the container at offset %zd",
                             NAME[t], cpos);
            else
                PyErr_Format(ThriftError, "%s %lld at offset %zd is out of range", NAME[t],
                             (long long)v, pos);
            return -1;
        }
    }
    *out = v;
    return 0;
}

static PyObject *c_value(R *r, Py_ssize_t *pp, int t, int depth, PyObject *sch);

static PyObject *c_struct(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp;
    if (depth <= 0)
        return too_deep(pos);
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    const uint8_t *b = r->b;
    PyObject *out = PyDict_New();
    long last = 0;
    while (out != NULL) {
        if (pos >= r->end) {
            truncated(pos, "a struct field");
            goto fail;
        }
        int h = b[pos];
        if (h == 0) {
            *pp = pos + 1;
            break;
        }
        int nib = h & 0x0F;
        long fid;
        Py_ssize_t p = pos + 1;
        if (h >> 4) {
            fid = last + (h >> 4);
        } else {
            uint64_t u;
            if (uvarint(r, &p, 5, 32, &u))
                goto fail;
            fid = (long)((int64_t)(u >> 1) ^ -(int64_t)(u & 1));
        }
        if (fid < -32768 || fid >= 32768) {
            PyErr_Format(ThriftError, "field id %ld at offset %zd is not an i16", fid, pos);
            goto fail;
        }
        last = fid;
        PyObject *v;
        if (nib == 1 || nib == 2) { /* a bool field carries its value in the type nibble */
            if (charge(r, 1, pos))
                goto fail;
            v = PyBool_FromLong(nib == 1);
        } else {
            int t = C_TYPE[nib];
            if (t < 0) {
                PyErr_Format(ThriftError, "unknown compact type %d of field %ld at offset %zd",
                             nib, fid, pos);
                goto fail;
            }
            if (charge(r, 1, pos))
                goto fail;
            PyObject *sub = field_schema(sch, (int)fid, t);
            if (sub == NULL)
                goto fail;
            v = c_value(r, &p, t, depth - 1, sub);
            Py_DECREF(sub);
        }
        if (v == NULL || set_item(out, PyLong_FromLong(fid), v) < 0)
            goto fail;
        pos = p;
    }
    Py_LeaveRecursiveCall();
    return out;
fail:
    Py_LeaveRecursiveCall();
    Py_XDECREF(out);
    return NULL;
}

/* n zigzag integers of type t from *pp into an array (numpy) or a list. */
static PyObject *c_ints(R *r, Py_ssize_t *pp, int t, Py_ssize_t n, int vec) {
    Py_ssize_t cpos = *pp;
    int bits = t == I64 ? 64 : 32;
    int64_t v;
    if (r->numpy) {
        char *data;
        PyObject *a = new_array(t, n, &data);
        for (Py_ssize_t i = 0; a && i < n; i++) {
            if (c_int(r, pp, t, bits, vec, cpos, &v)) {
                Py_CLEAR(a);
                break;
            }
            if (t == I64) {
                memcpy(data + 8 * i, &v, 8);
            } else if (t == I32) {
                int32_t x = (int32_t)v;
                memcpy(data + 4 * i, &x, 4);
            } else {
                int16_t x = (int16_t)v;
                memcpy(data + 2 * i, &x, 2);
            }
        }
        return a;
    }
    PyObject *items = PyList_New(n);
    for (Py_ssize_t i = 0; items && i < n; i++) {
        PyObject *x = c_int(r, pp, t, bits, vec, cpos, &v) ? NULL : PyLong_FromLongLong(v);
        if (x == NULL)
            Py_CLEAR(items);
        else
            PyList_SET_ITEM(items, i, x);
    }
    return items;
}

/* A bool element (0, 1 or 2; true is 1): -1 with ThriftError for anything else. */
static inline int c_bool(const uint8_t *p, Py_ssize_t pos) {
    if (*p > 2) {
        PyErr_Format(ThriftError, "bool element %d at offset %zd is not 0, 1 or 2", *p, pos);
        return -1;
    }
    return *p == 1;
}

static PyObject *c_list(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp;
    if (depth <= 0)
        return too_deep(pos);
    if (pos >= r->end)
        return truncated(pos, "a list header");
    const uint8_t *b = r->b;
    int h = b[pos];
    uint64_t n = h >> 4;
    Py_ssize_t p = pos + 1;
    if (n == 15 && uvarint(r, &p, 5, 32, &n))
        return NULL;
    int et = C_TYPE[h & 0x0F];
    if (et < 0) {
        PyErr_Format(ThriftError, "unknown compact element type %d at offset %zd", h & 0x0F, pos);
        return NULL;
    }
    if (check_count(r, p, (long long)n, et, -1))
        return NULL;
    Py_ssize_t start = p;
    int array = r->numpy && WIDTH[et];
    if (charge(r, array ? 1 : (Py_ssize_t)n, p))
        return NULL;
    PyObject *items;
    if (et == I16 || et == I32 || et == I64) {
        items = c_ints(r, &p, et, n, n >= VECTOR_MIN || r->numpy);
        *pp = p;
        return finish_list(items, sch, start);
    }
    if (et == DOUBLE || et == BYTE || et == BOOL) {
        int w = WIDTH[et];
        const uint8_t *e = b + p;
        if (et == BOOL)
            for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++)
                if (e[i] > 2) {
                    PyErr_Format(ThriftError, "a bool in the list at offset %zd is not 0, 1 or 2",
                                 pos);
                    return NULL;
                }
        *pp = p + n * w;
        if (array) {
            char *data;
            PyObject *a = new_array(et, n, &data);
            if (a != NULL) {
                if (et == DOUBLE) {
                    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
                        uint64_t u = le64(e + 8 * i);
                        memcpy(data + 8 * i, &u, 8);
                    }
                } else if (et == BYTE) {
                    memcpy(data, e, n);
                } else {
                    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++)
                        data[i] = e[i] == 1;
                }
            }
            return finish_list(a, sch, start);
        }
        items = PyList_New(n);
        for (Py_ssize_t i = 0; items && i < (Py_ssize_t)n; i++) {
            PyObject *v = et == DOUBLE ? PyFloat_FromDouble(as_double(le64(e + 8 * i)))
                          : et == BYTE ? PyLong_FromLong((int8_t)e[i])
                                       : PyBool_FromLong(e[i] == 1);
            if (v == NULL)
                Py_CLEAR(items);
            else
                PyList_SET_ITEM(items, i, v);
        }
        return finish_list(items, sch, start);
    }
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    PyObject *esch = element_schema(sch, et, 1);
    items = esch ? PyList_New(n) : NULL;
    if (et == STRING && esch == Py_None) {
        for (Py_ssize_t i = 0; items && i < (Py_ssize_t)n; i++) {
            uint64_t ln;
            Py_ssize_t s = p;
            PyObject *v = NULL;
            if (uvarint(r, &s, 5, 32, &ln) == 0) {
                if ((Py_ssize_t)ln > r->end - s)
                    PyErr_Format(ThriftError, "string length %llu at offset %zd; %zd remain",
                                 (unsigned long long)ln, p, r->end - s);
                else
                    v = PyBytes_FromStringAndSize((const char *)b + s, (Py_ssize_t)ln);
            }
            if (v == NULL) {
                Py_CLEAR(items);
                break;
            }
            PyList_SET_ITEM(items, i, v);
            p = s + (Py_ssize_t)ln;
        }
    } else {
        for (Py_ssize_t i = 0; items && i < (Py_ssize_t)n; i++) {
            PyObject *v = c_value(r, &p, et, depth - 1, esch);
            if (v == NULL)
                Py_CLEAR(items);
            else
                PyList_SET_ITEM(items, i, v);
        }
    }
    Py_XDECREF(esch);
    Py_LeaveRecursiveCall();
    *pp = p;
    return finish_list(items, sch, start);
}

/* One number of type t at *pp (compact encoding) into an array's item at out. */
static int c_number_into(R *r, Py_ssize_t *pp, int t, int bits, int vec, Py_ssize_t cpos,
                         char *out) {
    Py_ssize_t pos = *pp;
    int64_t v;
    switch (t) {
    case BOOL: {
        if (pos >= r->end) {
            truncated(pos, "a bool");
            return -1;
        }
        int x = c_bool(r->b + pos, pos);
        if (x < 0)
            return -1;
        *out = (char)x;
        *pp = pos + 1;
        return 0;
    }
    case BYTE:
        if (pos >= r->end) {
            truncated(pos, "a byte");
            return -1;
        }
        *out = (char)r->b[pos];
        *pp = pos + 1;
        return 0;
    case DOUBLE: {
        if (r->end - pos < 8) {
            truncated(pos, "a double");
            return -1;
        }
        uint64_t u = le64(r->b + pos);
        memcpy(out, &u, 8);
        *pp = pos + 8;
        return 0;
    }
    default:
        if (c_int(r, pp, t, bits, vec, cpos, &v))
            return -1;
        if (t == I64) {
            memcpy(out, &v, 8);
        } else if (t == I32) {
            int32_t x = (int32_t)v;
            memcpy(out, &x, 4);
        } else {
            int16_t x = (int16_t)v;
            memcpy(out, &x, 2);
        }
        return 0;
    }
}

static int is_varint(int t) { return t == I16 || t == I32 || t == I64; }

static PyObject *c_map(R *r, Py_ssize_t *pp, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp, p = pos;
    if (depth <= 0)
        return too_deep(pos);
    uint64_t n;
    if (uvarint(r, &p, 5, 32, &n))
        return NULL;
    if (n == 0) { /* an empty map carries no types */
        *pp = p;
        return PyDict_New();
    }
    if (p >= r->end)
        return truncated(p, "a map's types");
    const uint8_t *b = r->b;
    int kv = b[p];
    int kt = C_TYPE[kv >> 4], vt = C_TYPE[kv & 0x0F];
    if (kt < 0 || vt < 0) {
        PyErr_Format(ThriftError, "unknown compact element type %d at offset %zd",
                     kt < 0 ? kv >> 4 : kv & 0x0F, p);
        return NULL;
    }
    p += 1;
    if (check_count(r, p, (long long)n, kt, vt))
        return NULL;
    Py_ssize_t cpos = p;
    int numeric = WIDTH[kt] && WIDTH[vt];
    if (charge(r, r->numpy && numeric ? 3 : 2 * (Py_ssize_t)n, p))
        return NULL;
    if (Py_EnterRecursiveCall(" while decoding a Thrift record"))
        return NULL;
    PyObject *ksch = element_schema(sch, kt, 1);
    PyObject *vsch = ksch ? element_schema(sch, vt, 2) : NULL;
    PyObject *out = NULL;
    if (vsch == NULL)
        goto done;
    /* Python's vector paths: integer keys to integers, doubles or plain strings */
    int vec = is_varint(kt) && (n >= VECTOR_MIN || r->numpy) &&
              (is_varint(vt) || vt == DOUBLE || (vt == STRING && vsch == Py_None));
    int bits = vec && (kt == I64 || vt == I64) ? 64 : 32;
    int kbits = vec ? bits : (kt == I64 ? 64 : 32), vbits = vec ? bits : (vt == I64 ? 64 : 32);
    if (r->numpy && numeric) {
        char *kd, *vd;
        PyObject *ka = new_array(kt, n, &kd), *va = ka ? new_array(vt, n, &vd) : NULL;
        if (ka && va)
            for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++)
                if (c_number_into(r, &p, kt, kbits, vec, cpos, kd + i * WIDTH[kt]) ||
                    c_number_into(r, &p, vt, vbits, vec, cpos, vd + i * WIDTH[vt])) {
                    Py_CLEAR(ka);
                    Py_CLEAR(va);
                    break;
                }
        out = pair(ka, va);
        goto done;
    }
    if (is_varint(kt) && (is_varint(vt) || vt == DOUBLE || vt == STRING)) {
        /* numbers as keys: the dict is built as the entries are read */
        PyObject *d = new_dict(n);
        for (Py_ssize_t i = 0; d && i < (Py_ssize_t)n; i++) {
            int64_t k, x;
            PyObject *key = NULL, *val = NULL;
            if (c_int(r, &p, kt, kbits, vec, cpos, &k) == 0)
                key = PyLong_FromLongLong(k);
            if (key == NULL) {
            } else if (is_varint(vt)) {
                if (c_int(r, &p, vt, vbits, vec, cpos, &x) == 0)
                    val = PyLong_FromLongLong(x);
            } else if (vt == DOUBLE) {
                if (r->end - p < 8)
                    truncated(p, "a double");
                else
                    val = PyFloat_FromDouble(as_double(le64(b + p)));
                p += 8;
            } else {
                val = c_value(r, &p, STRING, depth - 1, vsch);
            }
            if (set_item(d, key, val) < 0)
                Py_CLEAR(d);
        }
        out = d;
        goto done;
    }
    PyObject *keys = PyList_New(n), *vals = keys ? PyList_New(n) : NULL;
    for (Py_ssize_t i = 0; vals && i < (Py_ssize_t)n; i++) {
        PyObject *k = c_value(r, &p, kt, depth - 1, ksch);
        PyObject *v = k ? c_value(r, &p, vt, depth - 1, vsch) : NULL;
        if (v == NULL) {
            Py_XDECREF(k);
            Py_CLEAR(vals);
            break;
        }
        PyList_SET_ITEM(keys, i, k);
        PyList_SET_ITEM(vals, i, v);
    }
    out = vals ? make_map(keys, vals, kt, cpos) : NULL;
    Py_XDECREF(keys);
    Py_XDECREF(vals);
done:
    Py_XDECREF(ksch);
    Py_XDECREF(vsch);
    Py_LeaveRecursiveCall();
    *pp = p;
    return out;
}

static PyObject *c_value(R *r, Py_ssize_t *pp, int t, int depth, PyObject *sch) {
    Py_ssize_t pos = *pp, left = r->end - pos;
    const uint8_t *p = r->b + pos;
    switch (t) {
    case BOOL: {
        if (left < 1)
            return truncated(pos, "a bool");
        int x = c_bool(p, pos);
        if (x < 0)
            return NULL;
        *pp = pos + 1;
        return PyBool_FromLong(x);
    }
    case BYTE:
        if (left < 1)
            return truncated(pos, "a byte");
        *pp = pos + 1;
        return PyLong_FromLong((int8_t)p[0]);
    case DOUBLE:
        if (left < 8)
            return truncated(pos, "a double");
        *pp = pos + 8;
        return PyFloat_FromDouble(as_double(le64(p)));
    case I16:
    case I32:
    case I64: {
        int64_t v;
        if (c_int(r, pp, t, t == I64 ? 64 : 32, 0, pos, &v))
            return NULL;
        return PyLong_FromLongLong(v);
    }
    case STRING: {
        uint64_t n;
        Py_ssize_t s = pos;
        if (uvarint(r, &s, 5, 32, &n))
            return NULL;
        if ((Py_ssize_t)n > r->end - s) {
            PyErr_Format(ThriftError, "string length %llu at offset %zd; %zd bytes remain",
                         (unsigned long long)n, pos, r->end - s);
            return NULL;
        }
        *pp = s + (Py_ssize_t)n;
        return string(r->b + s, (Py_ssize_t)n, pos, sch);
    }
    case UUID:
        if (left < 16)
            return truncated(pos, "a uuid");
        *pp = pos + 16;
        return uuid_at(p);
    case STRUCT:
        return c_struct(r, pp, depth, sch);
    case MAP:
        return c_map(r, pp, depth, sch);
    default: /* SET, LIST */
        return c_list(r, pp, depth, sch);
    }
}

/* ------------------------------------------------------------------ module */

static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "decode(buf, compact, schema, numpy, max_depth, max_objects)");
        return NULL;
    }
    if (ThriftError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_fast.setup() was not called");
        return NULL;
    }
    int compact = PyObject_IsTrue(args[1]), numpy = PyObject_IsTrue(args[3]);
    Py_ssize_t max_depth = PyLong_AsSsize_t(args[4]), max_objects = PyLong_AsSsize_t(args[5]);
    if (compact < 0 || numpy < 0 || (max_depth == -1 && PyErr_Occurred()) ||
        (max_objects == -1 && PyErr_Occurred()))
        return NULL;
    if (max_depth < 1 || max_objects < 1) {
        PyErr_SetString(PyExc_ValueError, "max_depth and max_objects must be positive");
        return NULL;
    }
    if (max_depth > INT_MAX)
        max_depth = INT_MAX;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    R r = {view.buf, view.len, max_objects - 1, max_objects, numpy}; /* the record's own dict */
    Py_ssize_t pos = 0;
    PyObject *v = compact ? c_struct(&r, &pos, (int)max_depth, args[2])
                          : b_struct(&r, &pos, (int)max_depth, args[2]);
    if (v != NULL && pos != r.end) {
        PyErr_Format(ThriftError, "%zd bytes follow the end of the struct at offset %zd",
                     r.end - pos, pos);
        Py_CLEAR(v);
    }
    PyBuffer_Release(&view);
    return v;
}

static PyObject *py_setup(PyObject *self, PyObject *args) {
    PyObject *error, *fs, *es, *fl, *as, *mm, *uu, *fb, *dt;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO!", &error, &fs, &es, &fl, &as, &mm, &uu, &fb,
                          &PyDict_Type, &dt))
        return NULL;
    PyObject *objs[8] = {error, fs, es, fl, as, mm, uu, fb};
    PyObject **slots[8] = {&ThriftError, &h_field_schema, &h_element_schema, &h_finish_list,
                           &h_as_string, &h_make_map, &h_uuid, &h_empty};
    for (int t = 0; t < NTYPES; t++) {
        if (!WIDTH[t])
            continue;
        PyObject *key = PyLong_FromLong(t);
        PyObject *d = key ? PyDict_GetItemWithError(dt, key) : NULL;
        Py_XDECREF(key);
        if (d == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_KeyError, "no dtype for type id %d", t);
            return NULL;
        }
        Py_XSETREF(dtypes[t], Py_NewRef(d));
    }
    for (int i = 0; i < 8; i++)
        Py_XSETREF(*slots[i], Py_NewRef(objs[i]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL,
     "decode(buf, compact, schema, numpy, max_depth, max_objects) -> dict: one Thrift struct."},
    {"setup", py_setup, METH_VARARGS,
     "setup(error, field_schema, element_schema, finish_list, as_string, make_map, "
     "uuid_from_bytes, empty, dtypes): the Python parts, once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }
