/* The C API through pkg-config: links libstrata_c.so and reads its version. */
#include <stdio.h>
#include <string.h>

#include "offload/strata_c.h"

int main(void) {
  const char* v = strata_version();
  printf("consumer_c: libstrata_c %s\n", v);
  return v != NULL && strlen(v) > 0 ? 0 : 1;
}
