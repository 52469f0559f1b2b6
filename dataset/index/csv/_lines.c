/* distlearn.dataset.index.csv._lines: one pass over a plain CSV/TSV index (no quotes, UTF-8),
 * in C. See dataset/index/csv/lines.py, its only caller, for the contract; in short:
 *
 *   count(buf, lo, hi) -> the number of "\n" bytes in buf[lo:hi]
 *   split(buf, lo, hi, sep, roles, names, at, start, length, codes, descents)
 *       -> (rows, labels, ndescents, end) or None
 *
 * split reads the lines of buf[lo:hi] (lo at a line's start), skips blank ones,
 * splits each at `sep`, strips each field of what str.strip() strips, and
 * copies each row's name into names[at:end], one after the other; per row r it
 * writes the name's offset in names (start[r], uint32) and length (length[r],
 * int16); for label column k (roles[c] = k + 1) the label's code
 * (codes[r * K + k], int16 or int32 as the buffer's items: the order of its first
 * appearance in this call, -1 where the field is missing or empty; OverflowError
 * where int16 codes run out). labels: the distinct labels, in code order.
 * descents: the rows r whose name is > row r + 1's, as many as fit (ndescents
 * counts them all).
 *
 * None where the bytes are not this reader's to read, so that the caller's others
 * (which name the fault) read them: a quote, a NUL, a "\r" not before "\n", bytes
 * that are not UTF-8, a space that is not ASCII at a field's edge, an empty name
 * or one longer than 32,767 bytes, a row with more fields than `roles`. The GIL is
 * let go while the bytes are read: two threads read two halves of a file at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* What str.strip() strips, in ASCII: \t \n \v \f \r, 0x1c-0x1f and the space. */
static int is_space(unsigned char c) {
    return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f);
}

/* Byte classes: a field goes on over PLAIN bytes; SEP (set per call), END ("\n"),
 * HIGH (a UTF-8 sequence starts: checked, then passed over) and REFUSED (the quote,
 * NUL, "\r" but before "\n") stop it. */
enum { PLAIN = 0, SEP = 1, END = 2, REFUSED = 3, HIGH = 4 };

/* The length of the UTF-8 sequence at p, 0 where it is not one Python decodes (an
 * overlong form, a surrogate, past U+10FFFF, cut short). Reads no further than the
 * first byte that is wrong: a line's "\n" stops it. */
static int utf8_length(const unsigned char *p) {
    unsigned char c = p[0];
    if (c >= 0xC2 && c <= 0xDF)
        return (p[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned char lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        return p[1] >= lo && p[1] <= hi && (p[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned char lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return p[1] >= lo && p[1] <= hi && (p[2] & 0xC0) == 0x80 && (p[3] & 0xC0) == 0x80 ? 4
                                                                                          : 0;
    }
    return 0;
}

/* Whether the (valid) UTF-8 character at p is one str.strip() strips: U+0085, U+00A0,
 * U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
static int is_wide_space(const unsigned char *p) {
    if (p[0] == 0xC2)
        return p[1] == 0x85 || p[1] == 0xA0;
    if (p[0] == 0xE1)
        return p[1] == 0x9A && p[2] == 0x80;
    if (p[0] == 0xE2)
        return (p[1] == 0x80 && (p[2] <= 0x8A || p[2] == 0xA8 || p[2] == 0xA9 || p[2] == 0xAF)) ||
               (p[1] == 0x81 && p[2] == 0x9F);
    if (p[0] == 0xE3)
        return p[1] == 0x80 && p[2] == 0x80;
    return 0;
}

/* A label's hash: its words folded in, then murmur3's finalizer, which carries the
 * high bits into the low ones the table's mask keeps (a multiply alone carries low
 * bits up only: labels that differ in their last bytes, id000001 to id099999, took
 * 10x the probes). */
static uint64_t hash(const unsigned char *p, uint32_t n) {
    uint64_t h = n, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 32;
    }
    if (n) {
        w = 0;
        memcpy(&w, p, n);
        h ^= w;
    }
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
}

/* The distinct labels met so far: open addressing, at most half full. */
typedef struct {
    const unsigned char *at;
    uint32_t len;
    int32_t code;
} Slot;

typedef struct {
    Slot *slots;
    uint64_t mask;
    int32_t used;
    Slot *by_code; /* cap of them */
    int32_t cap;
} Labels;

static int labels_init(Labels *t) {
    t->mask = 4095;
    t->used = 0;
    t->cap = 1024;
    t->slots = malloc((t->mask + 1) * sizeof(Slot));
    t->by_code = malloc((size_t)t->cap * sizeof(Slot));
    if (!t->slots || !t->by_code)
        return -1;
    for (uint64_t i = 0; i <= t->mask; i++)
        t->slots[i].code = -1;
    return 0;
}

static void labels_free(Labels *t) {
    free(t->slots);
    free(t->by_code);
}

static int labels_grow(Labels *t) {
    uint64_t mask = t->mask * 2 + 1;
    Slot *slots = malloc((mask + 1) * sizeof(Slot));
    if (!slots)
        return -1;
    for (uint64_t i = 0; i <= mask; i++)
        slots[i].code = -1;
    for (int32_t c = 0; c < t->used; c++) {
        Slot v = t->by_code[c];
        uint64_t j = hash(v.at, v.len) & mask;
        while (slots[j].code >= 0)
            j = (j + 1) & mask;
        slots[j] = v;
    }
    free(t->slots);
    t->slots = slots;
    t->mask = mask;
    return 0;
}

/* The code of label at[0:len], given one if new; -2 out of memory. */
static int32_t labels_code(Labels *t, const unsigned char *at, uint32_t len) {
    uint64_t j = hash(at, len) & t->mask;
    for (;; j = (j + 1) & t->mask) {
        Slot *v = &t->slots[j];
        if (v->code < 0)
            break;
        if (v->len == len && memcmp(v->at, at, len) == 0)
            return v->code;
    }
    if (t->used == t->cap) {
        Slot *more = realloc(t->by_code, (size_t)t->cap * 2 * sizeof(Slot));
        if (!more)
            return -2;
        t->by_code = more;
        t->cap *= 2;
    }
    int32_t code = t->used++;
    t->slots[j] = t->by_code[code] = (Slot){at, len, code};
    if ((uint64_t)t->used * 2 > t->mask && labels_grow(t) < 0)
        return -2;
    return code;
}

enum { OK = 0, NOT_MINE = 1, NO_MEMORY = 2, NARROW = 3 /* codes too narrow */ };

typedef struct {
    unsigned char cls[256];
    const unsigned char *roles; /* per column: 0 the name, k + 1 label k, 255 none */
    Py_ssize_t width;           /* columns */
    Py_ssize_t nlabels;         /* label columns (K) */
    unsigned char *names;       /* the names are copied here, one after the other */
    Py_ssize_t at, room;        /* from names[at], up to names[room] */
    uint32_t *start;
    int16_t *length;
    Py_ssize_t cap; /* rows start and length hold */
    void *codes; /* int16 or int32 */
    int wide;    /* int32 codes */
    int64_t *descents;
    Py_ssize_t most; /* descents holds */
    /* out */
    Py_ssize_t rows, ndescents;
    const unsigned char *prev; /* the last name read, and its length */
    uint32_t prev_len;
    unsigned char *tail; /* a copy of a last line without "\n", with one */
    Labels labels;
    Slot *last; /* each label column's last label (rows in label order repeat it) */
} Split;

/* One line, line[0:...] up to and including its "\n" (there is one); *next: the
 * line after it. */
static int split_line(Split *s, const unsigned char *line, const unsigned char **next) {
    const unsigned char *cls = s->cls, *q = line, *a;
    Py_ssize_t rows = s->rows, col = 0;
    Py_ssize_t row_codes = rows * s->nlabels; /* this row's first code */
    int has_name = 0;
    if (*q == '\n' || (q[0] == '\r' && q[1] == '\n')) {
        *next = q + (*q == '\n' ? 1 : 2);
        return OK; /* a blank line: no row (the csv module's []) */
    }
    if (rows == s->cap)
        return NOT_MINE; /* (more lines than counted: cannot be) */
    for (Py_ssize_t k = 0; k < s->nlabels; k++) {
        if (s->wide)
            ((int32_t *)s->codes)[row_codes + k] = -1;
        else
            ((int16_t *)s->codes)[row_codes + k] = -1;
    }
    for (;;) {
        a = q;
        int high = 0, stop; /* high: the field holds a byte >= 0x80 */
        for (;;) {
            while (cls[*q] == PLAIN)
                q++;
            stop = cls[*q];
            if (stop < REFUSED)
                break; /* (one compare on the way of every field) */
            if (stop == REFUSED) {
                if (!(q[0] == '\r' && q[1] == '\n'))
                    return NOT_MINE;
                stop = END; /* "\r\n" */
                break;
            }
            int n = utf8_length(q);
            if (!n)
                return NOT_MINE; /* not UTF-8: the caller's others name the fault */
            q += n;
            high = 1;
        }
        const unsigned char *z = q;
        if (col == s->width)
            return NOT_MINE; /* more fields than the header */
        while (a < z && is_space(*a))
            a++;
        while (z > a && is_space(z[-1]))
            z--;
        /* a space that is not ASCII at an edge: the others strip it */
        if (high && a < z && (*a >= 0x80 || z[-1] >= 0x80)) {
            const unsigned char *last = z - 1;
            while ((*last & 0xC0) == 0x80)
                last--;
            if ((*a >= 0x80 && is_wide_space(a)) || (*last >= 0x80 && is_wide_space(last)))
                return NOT_MINE;
        }
        uint32_t n = (uint32_t)(z - a);
        unsigned char role = s->roles[col];
        if (role == 0) {
            if (!n || n > INT16_MAX || s->at + n > s->room)
                return NOT_MINE; /* an empty name: the caller's others name its line */
            memcpy(s->names + s->at, a, n);
            s->start[rows] = (uint32_t)s->at;
            s->length[rows] = (int16_t)n;
            s->at += n;
            if (s->prev) {
                int c = memcmp(a, s->prev, n < s->prev_len ? n : s->prev_len);
                if (c < 0 || (c == 0 && n < s->prev_len)) { /* the last name > this one */
                    if (s->ndescents < s->most)
                        s->descents[s->ndescents] = rows - 1;
                    s->ndescents++;
                }
            }
            s->prev = a;
            s->prev_len = n;
            has_name = 1;
        } else if (role != 255 && n) {
            Slot *last = &s->last[role - 1];
            int32_t code = last->code;
            if (code < 0 || last->len != n || memcmp(last->at, a, n) != 0) {
                code = labels_code(&s->labels, a, n);
                if (code < -1)
                    return NO_MEMORY;
                *last = (Slot){a, n, code};
            }
            if (s->wide)
                ((int32_t *)s->codes)[row_codes + role - 1] = code;
            else if (code <= INT16_MAX)
                ((int16_t *)s->codes)[row_codes + role - 1] = (int16_t)code;
            else
                return NARROW;
        }
        col++;
        if (stop == END)
            break;
        q++;
    }
    if (!has_name)
        return NOT_MINE;
    *next = q + (*q == '\n' ? 1 : 2);
    s->rows = rows + 1;
    return OK;
}

/* The lines of buf[lo:hi] (lo at a line's start). A last line without "\n" is read
 * from a copy that has one; nothing of it outlives the call but its name's copy. */
static int split_lines(Split *s, const unsigned char *buf, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t end = hi;
    while (end > lo && buf[end - 1] != '\n')
        end--; /* (past the last "\n") */
    for (const unsigned char *line = buf + lo; line < buf + end;) {
        int status = split_line(s, line, &line);
        if (status != OK)
            return status;
    }
    if (end == hi)
        return OK;
    /* (freed by the caller, once it has read the labels, which may point into it) */
    s->tail = malloc((size_t)(hi - end) + 2);
    if (!s->tail)
        return NO_MEMORY;
    memcpy(s->tail, buf + end, (size_t)(hi - end));
    s->tail[hi - end] = '\n';
    s->tail[hi - end + 1] = 0;
    const unsigned char *after;
    return split_line(s, s->tail, &after);
}

/* A writable buffer of `n` items of `itemsize` bytes at least (itemsize 0: of 2 or 4). */
static int get_out(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n,
                   const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    Py_ssize_t size = itemsize ? itemsize : view->itemsize;
    if (view->itemsize != size || (!itemsize && size != 2 && size != 4) || view->len < n * size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items of %zd bytes wanted", what, n, size);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_count(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer in;
    Py_ssize_t lo, hi, n = 0;
    if (!PyArg_ParseTuple(args, "y*nn", &in, &lo, &hi))
        return NULL;
    if (lo < 0 || hi > in.len || lo > hi) {
        PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "count: range out of the buffer");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)in.buf + lo, *end = (const unsigned char *)in.buf + hi;
    Py_BEGIN_ALLOW_THREADS
    while (p < end && (p = memchr(p, '\n', (size_t)(end - p)))) {
        n++;
        p++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    return PyLong_FromSsize_t(n);
}

static PyObject *py_split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer in, roles, views[5] = {{0}};
    PyObject *outs[5]; /* names, start, length, codes, descents */
    Py_ssize_t lo, hi, at;
    int sep;
    if (!PyArg_ParseTuple(args, "y*nniy*OnOOOO", &in, &lo, &hi, &sep, &roles, &outs[0], &at,
                          &outs[1], &outs[2], &outs[3], &outs[4]))
        return NULL;
    PyObject *result = NULL;
    Split s = {0};
    int got = 0; /* how many of views hold a buffer */
    if (lo < 0 || hi > in.len || lo > hi || sep <= 0 || sep > 127 || sep == '"' || sep == '\r' ||
        sep == '\n') {
        PyErr_SetString(PyExc_ValueError, "split: range out of the buffer, or not a separator");
        goto done;
    }
    s.width = roles.len;
    for (Py_ssize_t c = 0; c < roles.len; c++) {
        unsigned char r = ((const unsigned char *)roles.buf)[c];
        if (r != 255 && (Py_ssize_t)r > s.nlabels)
            s.nlabels = r;
    }
    if (get_out(outs[0], &views[0], 1, 0, "names") < 0)
        goto done;
    got = 1;
    if (get_out(outs[1], &views[1], 4, 0, "start") < 0)
        goto done;
    got = 2;
    s.cap = views[1].len / 4;
    if (get_out(outs[2], &views[2], 2, s.cap, "length") < 0)
        goto done;
    got = 3;
    if (get_out(outs[3], &views[3], 0, s.cap * s.nlabels, "codes") < 0)
        goto done;
    s.wide = views[3].itemsize == 4;
    got = 4;
    if (get_out(outs[4], &views[4], 8, 0, "descents") < 0)
        goto done;
    got = 5;
    if (at < 0 || at > views[0].len) {
        PyErr_SetString(PyExc_ValueError, "split: `at` out of the names");
        goto done;
    }
    if (views[0].len >= ((Py_ssize_t)1 << 32)) {
        result = Py_NewRef(Py_None); /* (uint32 offsets) */
        goto done;
    }
    memset(s.cls, PLAIN, sizeof s.cls);
    for (int c = 0x80; c < 256; c++)
        s.cls[c] = HIGH;
    s.cls['"'] = s.cls[0] = s.cls['\r'] = REFUSED;
    s.cls['\n'] = END;
    s.cls[sep] = SEP;
    s.roles = roles.buf;
    s.names = views[0].buf;
    s.at = at;
    s.room = views[0].len;
    s.start = views[1].buf;
    s.length = views[2].buf;
    s.codes = views[3].buf;
    s.descents = views[4].buf;
    s.most = views[4].len / 8;
    s.last = malloc((size_t)(s.nlabels + 1) * sizeof(Slot));
    if (labels_init(&s.labels) < 0 || !s.last) {
        labels_free(&s.labels);
        free(s.last);
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k <= s.nlabels; k++)
        s.last[k].code = -1;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = split_lines(&s, in.buf, lo, hi);
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
    } else if (status == NARROW) {
        PyErr_SetString(PyExc_OverflowError, "split: more labels than int16 codes hold");
    } else if (status == NOT_MINE) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *labels = PyList_New(s.labels.used);
        for (int32_t k = 0; labels && k < s.labels.used; k++) {
            Slot v = s.labels.by_code[k];
            PyObject *name = PyUnicode_DecodeUTF8((const char *)v.at, v.len, NULL);
            if (!name) {
                Py_CLEAR(labels);
                break;
            }
            PyList_SET_ITEM(labels, k, name);
        }
        if (labels)
            result = Py_BuildValue("nNnn", s.rows, labels, s.ndescents, s.at);
    }
    labels_free(&s.labels);
    free(s.last);
    free(s.tail);
done:
    for (int k = 0; k < got; k++)
        PyBuffer_Release(&views[k]);
    PyBuffer_Release(&in);
    PyBuffer_Release(&roles);
    return result;
}

static PyMethodDef methods[] = {
    {"count", py_count, METH_VARARGS, "count(buf, lo, hi): the \"\\n\" bytes in buf[lo:hi]."},
    {"split", py_split, METH_VARARGS,
     "split(buf, lo, hi, sep, roles, names, at, start, length, codes, descents): see "
     "dataset/index/csv/lines.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lines", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lines(void) {
    return PyModule_Create(&module);
}
