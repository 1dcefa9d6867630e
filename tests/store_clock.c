/* A wall clock that a test sets: LD_PRELOAD this into a server and its
 * realtime clock reads the milliseconds in the file STORE_CLOCK_FILE (eight
 * bytes, a little-endian count since the Unix epoch), frozen until the test
 * writes another. Monotonic and other clocks stay real, so timers, waits and
 * timeouts inside the server go on as usual. No allocation and no libc
 * clock call: a preloaded clock runs before malloc is ready (jemalloc asks
 * for the time while it starts). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *clock_ms = NULL;

static int64_t read_ms(void) {
    if (clock_ms == NULL) {
        const char *path = getenv("STORE_CLOCK_FILE");
        int fd = path ? open(path, O_RDONLY) : -1;
        if (fd < 0)
            abort();
        void *map = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (map == MAP_FAILED)
            abort();
        clock_ms = map;
    }
    return *clock_ms;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (id != CLOCK_REALTIME && id != CLOCK_REALTIME_COARSE)
        return (int)syscall(SYS_clock_gettime, id, ts);
    int64_t ms = read_ms();
    ts->tv_sec = ms / 1000;
    ts->tv_nsec = (long)(ms % 1000) * 1000000L;
    return 0;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    {
        int64_t ms = read_ms();
        tv->tv_sec = ms / 1000;
        tv->tv_usec = (long)(ms % 1000) * 1000L;
    }
    return 0;
}

time_t time(time_t *out) {
    time_t now = (time_t)(read_ms() / 1000);
    if (out != NULL)
        *out = now;
    return now;
}
