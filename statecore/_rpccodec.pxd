# cython: language_level=3
"""The RPC value codec and frame envelope, compiled (see _rpccodec.pyx; the wire format is
described byte by byte in statecore.rpc's module docstring)."""
from libc.stdint cimport uint8_t

cdef enum:
    RPC_MAX_DEPTH = 64          # containers nest at most this deep, in both directions
    RPC_ENVELOPE_BYTES = 11     # kind u8 | request_id u64 | name_length u16
    RPC_FRAME_HEADER_BYTES = 15 # length u32, then the envelope's fixed part
    RPC_MAX_U32 = 0xFFFFFFFF

    # Value tags: one ASCII byte each.
    TAG_NONE = 0x4E     # N
    TAG_FALSE = 0x46    # F
    TAG_TRUE = 0x54     # T
    TAG_INT = 0x69      # i  8 bytes, signed
    TAG_FLOAT = 0x66    # f  8 bytes, IEEE 754 binary64
    TAG_STR = 0x73      # s  u32 byte length | utf-8
    TAG_BYTES = 0x62    # b  u32 length | bytes
    TAG_TUPLE = 0x74    # t  u32 count | values
    TAG_LIST = 0x6C     # l  u32 count | values
    TAG_DICT = 0x64     # d  u32 count | (key value) pairs

cdef struct Writer:
    # A growing output buffer. It starts in storage the caller provides (usually on its
    # stack, big enough for a typical message) and moves to the heap once it outgrows it;
    # the caller frees ``data`` when ``heap`` is set, whatever happened.
    uint8_t* data
    Py_ssize_t size
    Py_ssize_t capacity
    bint heap

cdef struct Reader:
    # Decoding state over borrowed bytes; every read is checked against ``size`` first.
    const uint8_t* data
    Py_ssize_t size
    Py_ssize_t pos      # the next byte to read
    Py_ssize_t start    # where the top-level value began (the truncation message counts from it)

cdef int encode_into(Writer* w, object value, int depth) except -1
cdef object decode_from(Reader* r, int depth)
