/*
 * safetensors.h: the safetensors checkpoint format (8-byte little-endian
 * header length, a JSON header naming each tensor's dtype, shape and byte
 * range, then the data). Read with pread, never mmap, so a file truncated
 * under the daemon gives an error, not SIGBUS.
 *
 * Error details go into a caller buffer (err, errlen) in words a user can act
 * on; the functions never log.
 */
#ifndef MOED_SAFETENSORS_H
#define MOED_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum st_dtype {
    ST_BOOL, ST_U8, ST_I8, ST_I16, ST_U16, ST_F16, ST_BF16, ST_I32, ST_U32,
    ST_F32, ST_F64, ST_I64, ST_U64, ST_F8_E4M3, ST_F8_E5M2,
    ST_DTYPE_COUNT
};

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER (100u << 20)

struct st_tensor {
    char *name;
    enum st_dtype dtype;
    int ndim;
    uint64_t shape[ST_MAX_DIMS];
    uint64_t offset; /* absolute byte offset in the file */
    uint64_t nbytes;
};

struct st_file {
    int fd;           /* -1 for a header parsed from memory */
    uint64_t size;    /* file size */
    size_t count;
    struct st_tensor *tensors; /* sorted by name */
};

/* Element size of a dtype; its name as the format spells it. */
size_t st_dtype_size(enum st_dtype dt);
const char *st_dtype_name(enum st_dtype dt);

/*
 * Parse a header (the JSON bytes, without the 8-byte length) of a file of
 * file_size bytes. Checks every tensor's dtype, shape, and that its byte
 * range matches the shape and lies inside the data section. Fills f (fd -1).
 * 0, -EINVAL (malformed, err says why) or -ENOMEM.
 */
int st_parse_header(const char *json, size_t json_len, uint64_t file_size,
                    struct st_file *f, char *err, size_t errlen);

/* Open and parse a file. Caller owns *out; release with st_close(). */
int st_open(const char *path, struct st_file **out, char *err, size_t errlen);
/* Take ownership of an open fd instead of a path (fd closed on error too). */
int st_open_fd(int fd, struct st_file **out, char *err, size_t errlen);
void st_close(struct st_file **f);
/* Release the tensor table of a header parsed with st_parse_header(). */
void st_header_done(struct st_file *f);

const struct st_tensor *st_find(const struct st_file *f, const char *name);

/* Read the tensor's bytes into dst (t->nbytes), in parts of at most
 * ST_READ_PART bytes. 0, -EIO (short file), -ECANCELED (st_cancel_reads). */
#define ST_READ_PART (64u << 20)
int st_read(const struct st_file *f, const struct st_tensor *t, void *dst);
/* moed is stopping: every tensor read fails from now on with -ECANCELED,
 * one under way before its next part, so a load in progress ends within a
 * part instead of holding up the stop. Any thread; there is no way back. */
void st_cancel_reads(void);
bool st_reads_cancelled(void);
/* For tests: fn runs after each part of a tensor read (NULL: nothing). */
void st_set_part_hook(void (*fn)(void));
/* Bytes read from weight files by this process so far (any thread): what
 * the start-up timeout's keeper counts as a load's progress (notify.c). */
uint64_t st_bytes_read(void);

/* A tensor for st_write(). */
struct st_out {
    const char *name;
    enum st_dtype dtype;
    int ndim;
    uint64_t shape[ST_MAX_DIMS];
    const void *data;
};

/* Whether st_write() could write path: 0 where it is a regular file, a
 * link (which the rename replaces) or nothing yet, in a directory this
 * process may write; else -EISDIR (a directory), -EINVAL (a device, a
 * FIFO, a socket: the rename would put a file in its place), or -errno
 * of the path or of its directory (ENOENT, EACCES, EROFS, ENOTDIR,
 * ENAMETOOLONG). */
int st_write_check(const char *path);

/* Write a safetensors file (replaced atomically: temp file, then rename);
 * what st_write_check() refuses is refused first, with its code. */
int st_write(const char *path, const struct st_out *tensors, size_t count);

#endif
