# cython: language_level=3
"""Float key normalization: the one table and the one rule (docs/formats.md, "Float keys").

Spark groups -0.0 with 0.0 and every NaN with every other (``NormalizeFloatingNumbers``;
its ``hash`` reads ``floatToIntBits``/``doubleToLongBits``, which fold every NaN into one),
so a key field of a float type is stored with -0.0 as +0.0 and any NaN as the canonical
quiet NaN. The bits decide (no float compare: a flush-to-zero mode would fold subnormals).
Every path that writes key rows or hashes float keys (RowSchema's per-row and batch
conversions, RowCodec, spark_hash) reads the constants below, through ``_float_keys.pyx``
from Python.
"""
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from *:
    # Per width: the sign bit alone (-0.0), the bits of +inf (a magnitude above them is a
    # NaN), and the canonical NaN (quiet bit set, no payload, sign clear: Java's and np.nan's).
    """
    #define SC_F32_SIGN 0x80000000U
    #define SC_F32_INF 0x7F800000U
    #define SC_F32_NAN 0x7FC00000U
    #define SC_F64_SIGN 0x8000000000000000ULL
    #define SC_F64_INF 0x7FF0000000000000ULL
    #define SC_F64_NAN 0x7FF8000000000000ULL
    """
    const uint32_t SC_F32_SIGN
    const uint32_t SC_F32_INF
    const uint32_t SC_F32_NAN
    const uint64_t SC_F64_SIGN
    const uint64_t SC_F64_INF
    const uint64_t SC_F64_NAN


cdef inline uint32_t key_bits32(uint32_t bits) noexcept nogil:
    """The bits a float32 key field holds for a value of these bits."""
    if bits == SC_F32_SIGN:
        return 0
    if (bits & ~SC_F32_SIGN) > SC_F32_INF:
        return SC_F32_NAN
    return bits


cdef inline uint64_t key_bits64(uint64_t bits) noexcept nogil:
    """The bits a float64 key field holds for a value of these bits."""
    if bits == SC_F64_SIGN:
        return 0
    if (bits & ~SC_F64_SIGN) > SC_F64_INF:
        return SC_F64_NAN
    return bits



cdef inline bint may_change32(uint32_t bits) noexcept nogil:
    """False when ``key_bits32`` keeps these bits (anything but -0.0, an infinity or a NaN):
    without branches, in 32-bit integer operations, so that a loop over a column vectorizes."""
    return (bits == SC_F32_SIGN) | (<int32_t>(bits & ~SC_F32_SIGN) > <int32_t>SC_F32_INF)


cdef inline bint may_change64(uint32_t high) noexcept nogil:
    """False when ``key_bits64`` keeps a float64 whose upper 32 bits are ``high`` (anything but
    a value with -0.0's upper half, an infinity or a NaN): as :func:`may_change32`, vectorizes."""
    return ((high == <uint32_t>(SC_F64_SIGN >> 32))
            | (<int32_t>(high & ~<uint32_t>(SC_F64_SIGN >> 32)) >= <int32_t>(SC_F64_INF >> 32)))
