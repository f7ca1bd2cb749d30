/* Vectorscan (libhs) loaded on first use: a policy without regex redactors never maps
 * it, nor the C++ runtime it pulls in (its relocations were a large part of a `stockade
 * run` start). These definitions stand in for the library's own: core/redact.c calls the
 * hs.h API as usual, and the first call dlopen()s the library by its soname (HS_SONAME,
 * from the Makefile). While it cannot be loaded, every call fails (a compile with an error
 * that says why), so redaction fails closed; the next call tries again. Generated
 * from hs.h; the allocator setters are left out (nothing sets them). */
#include <dlfcn.h>
#include <hs.h>
#include <pthread.h>
#include <stdio.h>

#ifndef HS_SONAME
#define HS_SONAME "libhs.so.5"
#endif

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static void *lib;               /* under load_lock; once set, for the process's life */
/* why the last call of this thread found nothing: per thread, since a retry in another
 * thread could rewrite it while this one reads it */
static __thread char load_error_text[256];
static __thread hs_compile_error_t load_error;

/* The library, loaded by whichever thread asks first. A failed load is not remembered:
 * its cause may pass (EMFILE, ENOMEM in a busy server), and a policy reload with
 * redactors would fail until a restart. So each call that finds it missing (a compile,
 * in practice: nothing else comes before one) tries again; a failed dlopen costs a few
 * syscalls. Each definition below keeps the symbol it resolved. */
static void *sym(const char *name)
{
    pthread_mutex_lock(&load_lock);
    if (!lib) {
        lib = dlopen(HS_SONAME, RTLD_NOW | RTLD_LOCAL);
        if (!lib)
            snprintf(load_error_text, sizeof load_error_text,
                     "Vectorscan (%s) cannot be loaded: %s", HS_SONAME, dlerror());
    }
    void *loaded = lib;
    pthread_mutex_unlock(&load_lock);
    void *found = loaded ? dlsym(loaded, name) : NULL;
    if (loaded && !found)
        snprintf(load_error_text, sizeof load_error_text, "Vectorscan (%s) has no %s",
                 HS_SONAME, name);
    return found;
}

/* a compile that cannot reach the library says why, as a compile error (freed, by
 * hs_free_compile_error, in the thread that got it) */
static hs_error_t unavailable(hs_compile_error_t **error)
{
    load_error = (hs_compile_error_t){load_error_text, -1};
    if (error)
        *error = &load_error;
    return HS_COMPILER_ERROR;
}

hs_error_t hs_open_stream(const hs_database_t *db, unsigned int flags, hs_stream_t **stream)
{
    static __typeof__(&hs_open_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_open_stream))sym("hs_open_stream");
    return fn ? fn(db, flags, stream) : HS_INVALID;
}

hs_error_t hs_scan_stream(hs_stream_t *id, const char *data, unsigned int length,
                          unsigned int flags, hs_scratch_t *scratch,
                          match_event_handler onEvent, void *ctxt)
{
    static __typeof__(&hs_scan_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_scan_stream))sym("hs_scan_stream");
    return fn ? fn(id, data, length, flags, scratch, onEvent, ctxt) : HS_INVALID;
}

hs_error_t hs_close_stream(hs_stream_t *id, hs_scratch_t *scratch,
                           match_event_handler onEvent, void *ctxt)
{
    static __typeof__(&hs_close_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_close_stream))sym("hs_close_stream");
    return fn ? fn(id, scratch, onEvent, ctxt) : HS_INVALID;
}

hs_error_t hs_reset_stream(hs_stream_t *id, unsigned int flags, hs_scratch_t *scratch,
                           match_event_handler onEvent, void *context)
{
    static __typeof__(&hs_reset_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_reset_stream))sym("hs_reset_stream");
    return fn ? fn(id, flags, scratch, onEvent, context) : HS_INVALID;
}

hs_error_t hs_copy_stream(hs_stream_t **to_id, const hs_stream_t *from_id)
{
    static __typeof__(&hs_copy_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_copy_stream))sym("hs_copy_stream");
    return fn ? fn(to_id, from_id) : HS_INVALID;
}

hs_error_t hs_reset_and_copy_stream(hs_stream_t *to_id, const hs_stream_t *from_id,
                                    hs_scratch_t *scratch, match_event_handler onEvent,
                                    void *context)
{
    static __typeof__(&hs_reset_and_copy_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_reset_and_copy_stream))sym("hs_reset_and_copy_stream");
    return fn ? fn(to_id, from_id, scratch, onEvent, context) : HS_INVALID;
}

hs_error_t hs_compress_stream(const hs_stream_t *stream, char *buf, size_t buf_space,
                              size_t *used_space)
{
    static __typeof__(&hs_compress_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_compress_stream))sym("hs_compress_stream");
    return fn ? fn(stream, buf, buf_space, used_space) : HS_INVALID;
}

hs_error_t hs_expand_stream(const hs_database_t *db, hs_stream_t **stream, const char *buf,
                            size_t buf_size)
{
    static __typeof__(&hs_expand_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_expand_stream))sym("hs_expand_stream");
    return fn ? fn(db, stream, buf, buf_size) : HS_INVALID;
}

hs_error_t hs_reset_and_expand_stream(hs_stream_t *to_stream, const char *buf,
                                      size_t buf_size, hs_scratch_t *scratch,
                                      match_event_handler onEvent, void *context)
{
    static __typeof__(&hs_reset_and_expand_stream) fn;
    if (!fn)
        fn = (__typeof__(&hs_reset_and_expand_stream))sym("hs_reset_and_expand_stream");
    return fn ? fn(to_stream, buf, buf_size, scratch, onEvent, context) : HS_INVALID;
}

hs_error_t hs_scan(const hs_database_t *db, const char *data, unsigned int length,
                   unsigned int flags, hs_scratch_t *scratch, match_event_handler onEvent,
                   void *context)
{
    static __typeof__(&hs_scan) fn;
    if (!fn)
        fn = (__typeof__(&hs_scan))sym("hs_scan");
    return fn ? fn(db, data, length, flags, scratch, onEvent, context) : HS_INVALID;
}

hs_error_t hs_scan_vector(const hs_database_t *db, const char *const *data,
                          const unsigned int *length, unsigned int count, unsigned int flags,
                          hs_scratch_t *scratch, match_event_handler onEvent, void *context)
{
    static __typeof__(&hs_scan_vector) fn;
    if (!fn)
        fn = (__typeof__(&hs_scan_vector))sym("hs_scan_vector");
    return fn ? fn(db, data, length, count, flags, scratch, onEvent, context) : HS_INVALID;
}

hs_error_t hs_alloc_scratch(const hs_database_t *db, hs_scratch_t **scratch)
{
    static __typeof__(&hs_alloc_scratch) fn;
    if (!fn)
        fn = (__typeof__(&hs_alloc_scratch))sym("hs_alloc_scratch");
    return fn ? fn(db, scratch) : HS_INVALID;
}

hs_error_t hs_clone_scratch(const hs_scratch_t *src, hs_scratch_t **dest)
{
    static __typeof__(&hs_clone_scratch) fn;
    if (!fn)
        fn = (__typeof__(&hs_clone_scratch))sym("hs_clone_scratch");
    return fn ? fn(src, dest) : HS_INVALID;
}

hs_error_t hs_scratch_size(const hs_scratch_t *scratch, size_t *scratch_size)
{
    static __typeof__(&hs_scratch_size) fn;
    if (!fn)
        fn = (__typeof__(&hs_scratch_size))sym("hs_scratch_size");
    return fn ? fn(scratch, scratch_size) : HS_INVALID;
}

hs_error_t hs_free_scratch(hs_scratch_t *scratch)
{
    if (!scratch)
        return HS_SUCCESS;      /* never loads the library */
    static __typeof__(&hs_free_scratch) fn;
    if (!fn)
        fn = (__typeof__(&hs_free_scratch))sym("hs_free_scratch");
    return fn ? fn(scratch) : HS_INVALID;
}

hs_error_t hs_compile(const char *expression, unsigned int flags, unsigned int mode,
                      const hs_platform_info_t *platform, hs_database_t **db,
                      hs_compile_error_t **error)
{
    static __typeof__(&hs_compile) fn;
    if (!fn)
        fn = (__typeof__(&hs_compile))sym("hs_compile");
    return fn ? fn(expression, flags, mode, platform, db, error) : unavailable(error);
}

hs_error_t hs_compile_multi(const char *const *expressions, const unsigned int *flags,
                            const unsigned int *ids, unsigned int elements, unsigned int mode,
                            const hs_platform_info_t *platform, hs_database_t **db,
                            hs_compile_error_t **error)
{
    static __typeof__(&hs_compile_multi) fn;
    if (!fn)
        fn = (__typeof__(&hs_compile_multi))sym("hs_compile_multi");
    return fn ? fn(expressions, flags, ids, elements, mode, platform, db, error) : unavailable(error);
}

hs_error_t hs_compile_ext_multi(const char *const *expressions, const unsigned int *flags,
                                const unsigned int *ids, const hs_expr_ext_t *const *ext,
                                unsigned int elements, unsigned int mode,
                                const hs_platform_info_t *platform, hs_database_t **db,
                                hs_compile_error_t **error)
{
    static __typeof__(&hs_compile_ext_multi) fn;
    if (!fn)
        fn = (__typeof__(&hs_compile_ext_multi))sym("hs_compile_ext_multi");
    return fn ? fn(expressions, flags, ids, ext, elements, mode, platform, db, error) : unavailable(error);
}

hs_error_t hs_compile_lit(const char *expression, unsigned flags, const size_t len,
                          unsigned mode, const hs_platform_info_t *platform,
                          hs_database_t **db, hs_compile_error_t **error)
{
    static __typeof__(&hs_compile_lit) fn;
    if (!fn)
        fn = (__typeof__(&hs_compile_lit))sym("hs_compile_lit");
    return fn ? fn(expression, flags, len, mode, platform, db, error) : unavailable(error);
}

hs_error_t hs_compile_lit_multi(const char * const *expressions, const unsigned *flags,
                                const unsigned *ids, const size_t *lens, unsigned elements,
                                unsigned mode, const hs_platform_info_t *platform,
                                hs_database_t **db, hs_compile_error_t **error)
{
    static __typeof__(&hs_compile_lit_multi) fn;
    if (!fn)
        fn = (__typeof__(&hs_compile_lit_multi))sym("hs_compile_lit_multi");
    return fn ? fn(expressions, flags, ids, lens, elements, mode, platform, db, error) : unavailable(error);
}

hs_error_t hs_free_compile_error(hs_compile_error_t *error)
{
    if (!error || error == &load_error)
        return HS_SUCCESS;
    static __typeof__(&hs_free_compile_error) fn;
    if (!fn)
        fn = (__typeof__(&hs_free_compile_error))sym("hs_free_compile_error");
    return fn ? fn(error) : HS_INVALID;
}

hs_error_t hs_expression_info(const char *expression, unsigned int flags,
                              hs_expr_info_t **info, hs_compile_error_t **error)
{
    static __typeof__(&hs_expression_info) fn;
    if (!fn)
        fn = (__typeof__(&hs_expression_info))sym("hs_expression_info");
    return fn ? fn(expression, flags, info, error) : unavailable(error);
}

hs_error_t hs_expression_ext_info(const char *expression, unsigned int flags,
                                  const hs_expr_ext_t *ext, hs_expr_info_t **info,
                                  hs_compile_error_t **error)
{
    static __typeof__(&hs_expression_ext_info) fn;
    if (!fn)
        fn = (__typeof__(&hs_expression_ext_info))sym("hs_expression_ext_info");
    return fn ? fn(expression, flags, ext, info, error) : unavailable(error);
}

hs_error_t hs_populate_platform(hs_platform_info_t *platform)
{
    static __typeof__(&hs_populate_platform) fn;
    if (!fn)
        fn = (__typeof__(&hs_populate_platform))sym("hs_populate_platform");
    return fn ? fn(platform) : HS_INVALID;
}

hs_error_t hs_free_database(hs_database_t *db)
{
    if (!db)
        return HS_SUCCESS;      /* never loads the library */
    static __typeof__(&hs_free_database) fn;
    if (!fn)
        fn = (__typeof__(&hs_free_database))sym("hs_free_database");
    return fn ? fn(db) : HS_INVALID;
}

hs_error_t hs_serialize_database(const hs_database_t *db, char **bytes, size_t *length)
{
    static __typeof__(&hs_serialize_database) fn;
    if (!fn)
        fn = (__typeof__(&hs_serialize_database))sym("hs_serialize_database");
    return fn ? fn(db, bytes, length) : HS_INVALID;
}

hs_error_t hs_deserialize_database(const char *bytes, const size_t length, hs_database_t **db)
{
    static __typeof__(&hs_deserialize_database) fn;
    if (!fn)
        fn = (__typeof__(&hs_deserialize_database))sym("hs_deserialize_database");
    return fn ? fn(bytes, length, db) : HS_INVALID;
}

hs_error_t hs_deserialize_database_at(const char *bytes, const size_t length,
                                      hs_database_t *db)
{
    static __typeof__(&hs_deserialize_database_at) fn;
    if (!fn)
        fn = (__typeof__(&hs_deserialize_database_at))sym("hs_deserialize_database_at");
    return fn ? fn(bytes, length, db) : HS_INVALID;
}

hs_error_t hs_stream_size(const hs_database_t *database, size_t *stream_size)
{
    static __typeof__(&hs_stream_size) fn;
    if (!fn)
        fn = (__typeof__(&hs_stream_size))sym("hs_stream_size");
    return fn ? fn(database, stream_size) : HS_INVALID;
}

hs_error_t hs_database_size(const hs_database_t *database, size_t *database_size)
{
    static __typeof__(&hs_database_size) fn;
    if (!fn)
        fn = (__typeof__(&hs_database_size))sym("hs_database_size");
    return fn ? fn(database, database_size) : HS_INVALID;
}

hs_error_t hs_serialized_database_size(const char *bytes, const size_t length,
                                       size_t *deserialized_size)
{
    static __typeof__(&hs_serialized_database_size) fn;
    if (!fn)
        fn = (__typeof__(&hs_serialized_database_size))sym("hs_serialized_database_size");
    return fn ? fn(bytes, length, deserialized_size) : HS_INVALID;
}

hs_error_t hs_database_info(const hs_database_t *database, char **info)
{
    static __typeof__(&hs_database_info) fn;
    if (!fn)
        fn = (__typeof__(&hs_database_info))sym("hs_database_info");
    return fn ? fn(database, info) : HS_INVALID;
}

hs_error_t hs_serialized_database_info(const char *bytes, size_t length, char **info)
{
    static __typeof__(&hs_serialized_database_info) fn;
    if (!fn)
        fn = (__typeof__(&hs_serialized_database_info))sym("hs_serialized_database_info");
    return fn ? fn(bytes, length, info) : HS_INVALID;
}

const char * hs_version(void)
{
    static __typeof__(&hs_version) fn;
    if (!fn)
        fn = (__typeof__(&hs_version))sym("hs_version");
    return fn ? fn() : "unavailable";
}

hs_error_t hs_valid_platform(void)
{
    static __typeof__(&hs_valid_platform) fn;
    if (!fn)
        fn = (__typeof__(&hs_valid_platform))sym("hs_valid_platform");
    return fn ? fn() : HS_INVALID;
}
