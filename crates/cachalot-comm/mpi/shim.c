/*
 * The MPI calls the Rust MPI backend (src/mpi.rs) makes, as plain C functions over
 * MPI_COMM_WORLD: MPI's handles (MPI_Comm, MPI_Datatype) are pointers in Open MPI and integers in
 * MPICH, so Rust does not name them; it calls these, compiled against the installed mpi.h by
 * build.rs (cargo feature `mpi`). Every function returns MPI's error code (MPI_SUCCESS is 0):
 * the world communicator returns errors (MPI_ERRORS_RETURN) instead of aborting, so Rust reports
 * them as CommErrors.
 */
#include <mpi.h>
#include <stdint.h>
#include <string.h>

/* Starts MPI (threads: serialized calls from any thread; the Rust side holds a lock around every
 * call) and says this process's rank, the world's size, the ranks on this host and the thread
 * level MPI provided. *already is 1 when MPI was started before (then only the figures are
 * read). */
int cachalot_mpi_init(int *rank, int *size, int *host_ranks, int *provided, int *already) {
    int flag = 0, rc;
    MPI_Comm host;
    rc = MPI_Initialized(&flag);
    if (rc != MPI_SUCCESS) return rc;
    *already = flag;
    if (!flag) {
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, provided);
        if (rc != MPI_SUCCESS) return rc;
    } else {
        rc = MPI_Query_thread(provided);
        if (rc != MPI_SUCCESS) return rc;
    }
    rc = MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Comm_rank(MPI_COMM_WORLD, rank);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Comm_size(MPI_COMM_WORLD, size);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Comm_size(host, host_ranks);
    MPI_Comm_free(&host);
    return rc;
}

/* The thread level cachalot needs, for the check against `provided`. */
int cachalot_mpi_thread_serialized(void) { return MPI_THREAD_SERIALIZED; }

/* The collectives are nonblocking: each starts the operation and keeps its request here; the
 * Rust side polls cachalot_mpi_test until it is done (spinning briefly, then sleeping, so a
 * rank that waits long, as an idle server's, does not hold a core). Calls are serialized by the
 * Rust side's lock and each waits for its request before the next starts, so one request is
 * pending at most. */
static MPI_Request pending = MPI_REQUEST_NULL;

/* Whether the pending operation is done (*done 1; the request is then freed). */
int cachalot_mpi_test(int *done) { return MPI_Test(&pending, done, MPI_STATUS_IGNORE); }

/* `bytes` bytes from every rank, in rank order, into `all` (bytes * size). */
int cachalot_mpi_iallgather(const void *mine, int bytes, void *all) {
    return MPI_Iallgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, MPI_COMM_WORLD, &pending);
}

int cachalot_mpi_iallgatherv(const void *mine, int bytes, void *all, const int *counts,
                             const int *displs) {
    return MPI_Iallgatherv(mine, bytes, MPI_BYTE, all, counts, displs, MPI_BYTE, MPI_COMM_WORLD,
                           &pending);
}

int cachalot_mpi_ialltoallv(const void *send, const int *scounts, const int *sdispls,
                            void *recv, const int *rcounts, const int *rdispls) {
    return MPI_Ialltoallv(send, scounts, sdispls, MPI_BYTE, recv, rcounts, rdispls, MPI_BYTE,
                          MPI_COMM_WORLD, &pending);
}

int cachalot_mpi_ibcast(void *buf, int bytes, int root) {
    return MPI_Ibcast(buf, bytes, MPI_BYTE, root, MPI_COMM_WORLD, &pending);
}

int cachalot_mpi_ibarrier(void) { return MPI_Ibarrier(MPI_COMM_WORLD, &pending); }

/* MPI's text for an error code into buf (at least MPI_MAX_ERROR_STRING bytes; *len set). */
int cachalot_mpi_error_string(int code, char *buf, int *len) {
    return MPI_Error_string(code, buf, len);
}

int cachalot_mpi_max_error_string(void) { return MPI_MAX_ERROR_STRING; }

int cachalot_mpi_finalize(void) {
    int done = 0;
    MPI_Finalized(&done);
    return done ? MPI_SUCCESS : MPI_Finalize();
}

int cachalot_mpi_abort(int code) { return MPI_Abort(MPI_COMM_WORLD, code); }
