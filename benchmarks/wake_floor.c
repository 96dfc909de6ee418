/* The platform floor for any loop that sleeps between samples: CPU per clock_nanosleep wake at
 * ~1 kHz (no NVML call).  gcc -O2 -o wake_floor benchmarks/wake_floor.c && ./wake_floor */
#include <stdio.h>
#include <time.h>
#include <sys/resource.h>
int main(){ struct timespec d={0,900000}; struct rusage a,b; struct timespec w0,w1;
 clock_gettime(CLOCK_MONOTONIC,&w0); getrusage(RUSAGE_SELF,&a);
 for(int i=0;i<2000;i++) clock_nanosleep(CLOCK_MONOTONIC,0,&d,0);
 getrusage(RUSAGE_SELF,&b); clock_gettime(CLOCK_MONOTONIC,&w1);
 double cpu=(b.ru_utime.tv_sec-a.ru_utime.tv_sec)+(b.ru_stime.tv_sec-a.ru_stime.tv_sec)+1e-6*((b.ru_utime.tv_usec-a.ru_utime.tv_usec)+(b.ru_stime.tv_usec-a.ru_stime.tv_usec));
 double wall=(w1.tv_sec-w0.tv_sec)+1e-9*(w1.tv_nsec-w0.tv_nsec);
 printf("cpu frac %.4f per wake %.1f us\n", cpu/wall, cpu/2000*1e6);}
