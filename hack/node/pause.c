/* The local node's pod sandbox ("pause") process: it holds a Pod's namespaces open and, as the pid 1
 * of a Pod that shares its process namespace, reaps orphans. No registry is reachable from these
 * machines, so hack/localnode.py builds it with `cc -static` and packs it into an image itself. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { _exit(sig == SIGINT || sig == SIGTERM ? 0 : 2); }

static void reap(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

int main(void) {
	struct sigaction stop = {.sa_handler = quit}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
	if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) || sigaction(SIGCHLD, &child, NULL))
		return 1;
	for (;;)
		pause();
}
