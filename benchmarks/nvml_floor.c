/* The floor for reading NVML memory from a loop, in C (no Python, no Ray).
 *   gcc -O2 -o nvml_floor benchmarks/nvml_floor.c -I/usr/local/cuda/include -lnvidia-ml
 *   ./nvml_floor 3          back to back for 3 s: calls per second
 *   ./nvml_floor 10 paced   1 kHz on absolute deadlines for 10 s: CPU share of one core, and the
 *                           latency of a call made after a 1 ms sleep (p50/p99, microseconds) */
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + 1e-6 * (r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 3.0;
  int paced = argc > 2 && strcmp(argv[2], "paced") == 0;
  nvmlDevice_t dev;
  nvmlMemory_v2_t mem;
  if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &dev) != NVML_SUCCESS) {
    fprintf(stderr, "nvml init failed\n");
    return 1;
  }
  if (!paced) {
    long n = 0;
    double t0 = now(), t = t0;
    while (t - t0 < seconds) {
      for (int i = 0; i < 1000; i++) {
        mem.version = nvmlMemory_v2;
        if (nvmlDeviceGetMemoryInfo_v2(dev, &mem) != NVML_SUCCESS) return 2;
      }
      n += 1000;
      t = now();
    }
    printf("{\"c_loop_hz\": %.1f}\n", n / (t - t0));
  } else {
    long n = (long)(seconds * 1000);
    double *lat = malloc(sizeof(double) * n);
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    double c0 = cpu_s(), t0 = now();
    for (long i = 0; i < n; i++) {
      double a = now();
      mem.version = nvmlMemory_v2;
      if (nvmlDeviceGetMemoryInfo_v2(dev, &mem) != NVML_SUCCESS) return 2;
      lat[i] = (now() - a) * 1e6;
      dl.tv_nsec += 1000000;
      if (dl.tv_nsec >= 1000000000) { dl.tv_nsec -= 1000000000; dl.tv_sec++; }
      clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &dl, NULL);
    }
    double wall = now() - t0, cpu = cpu_s() - c0;
    qsort(lat, n, sizeof(double), cmp);
    printf("{\"c_paced_1khz_cpu_frac\": %.4f, \"call_us_p50\": %.1f, \"call_us_p99\": %.1f, "
           "\"rate_hz\": %.1f}\n", cpu / wall, lat[n / 2], lat[n * 99 / 100], n / wall);
  }
  nvmlShutdown();
  return 0;
}
