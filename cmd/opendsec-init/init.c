// opendsec-init is the PID 1 of every container sandbox. It is tiny on
// purpose: an idle sandbox runs only this process. It installs the
// sandbox's seccomp filter, takes the agent's listening unix socket (made by
// the node and inherited, or created here), reaps every orphan, and starts
// the agent server (opendsec-agent) on demand. While no server runs, init
// accepts the next connection itself: a GET /health it answers as the agent
// would (the node asks for it after every create, and no agent need start
// for that); any other request starts the server, which gets the connection
// untouched. The server exits after an idle spell (--idle-exit) and is
// started again by the next request; connections queue in the kernel
// meanwhile.
//
// Usage:
//
//	opendsec-init [--seccomp-filter PATH] (--listen PATH | --listen-fd N) [--env-file PATH] -- SERVER [ARGS...]
//
// With --listen-fd the socket is already bound and listening (the node makes
// it before the container starts, so connections queue from the first
// instant); with --listen init makes it. When the --env-file exists at boot
// (a sandbox prestarted for the node's warm pool gets its caller's
// environment only when it is let run), its NUL-separated K=V entries are
// the server's environment instead of init's own, and the file is removed.
//
// SERVER gets ARGS plus "--listen-fd 3 --conn-fd 4 --ready-fd 5": the
// listening socket, the connection that made init start it (to serve
// first), and a pipe on which it writes one byte once it serves. A server
// that dies before that byte gets init's 503 written to that connection,
// with how it ended; /health answers the same until a server serves.
//
// Why C, in a Go project: init runs once per sandbox, on the create path,
// and then for the sandbox's whole life. The start of an empty program
// costs ~1.1 ms of CPU on these machines in Go (page faults of its heap
// and stacks, its threads), ~0.3 ms with static glibc, ~0.05 ms with
// static musl (scripts/build-init.sh uses musl where it can); an idle Go
// init kept three threads and 630 kB of anonymous memory, where this one
// keeps one thread and 40 kB (its binary's pages are the page cache's,
// shared by every sandbox). Every thread on the host costs each later container
// create (the OCI runtime's pivot_root walks them all). See
// bench/results/2026-12-06-init-c.md and docs/ARCHITECTURE.md.
//
// Init is one thread and one wait: an epoll set of a signalfd (SIGCHLD,
// SIGTERM, SIGINT), the listening socket (while no server runs), a
// connection it reads the start of, and a started server's ready pipe, with
// timeouts for backoff and deadlines. It uses nothing of libc but system
// call wrappers and string functions, builds with musl or glibc, and is
// linked static.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

// The kernel's seccomp filter program (linux/filter.h, linux/seccomp.h),
// spelled out: musl's headers have no linux/ directory.
struct bpf_insn8 {
	uint16_t code;
	uint8_t jt, jf;
	uint32_t k;
};
struct bpf_prog_hdr {
	unsigned short len;
	struct bpf_insn8 *filter;
};
enum { seccomp_set_mode_filter = 1 };

static const char usage[] =
    "usage: opendsec-init [--seccomp-filter PATH] (--listen PATH | --listen-fd N) [--env-file PATH] -- SERVER [ARGS...]";

// Server fds: the listening socket, the connection that made init start it
// (served first), and the write end of a pipe on which the server writes
// one byte once it serves.
enum { listen_fd = 3, conn_fd = 4, ready_fd = 5 };

// listen_backlog is the socket's accept queue: connections wait there while
// no server runs (the kernel caps it at net.core.somaxconn).
enum { listen_backlog = 4096 };

// Respawn backoff after a server that fails at start, in ms; a server that
// exits non-zero sooner than start_window after its start counts as failing
// to start.
enum { min_backoff = 100, max_backoff = 10000, start_window = 5000 };

// peek_timeout bounds the wait for a new connection's first bytes (a client
// that sends nothing in time gets the server, which has its own timeouts)
// and, the same, for a GET /health's head.
enum { peek_timeout = 1000 };

// ready_grace bounds the wait, after the server's exit, for its ready
// report: the pipe is closed by then unless a child of the server holds it.
enum { ready_grace = 200 };

// head_max is the most of a GET /health's head init reads.
enum { head_max = 8 << 10 };

// msg_max bounds one message init makes (log lines, failures, answers).
enum { msg_max = 8192 };

static const char health_prefix[] = "GET /health";

struct config {
	const char *seccomp;  // seccomp BPF program to install first; NULL: none
	const char *listen;   // unix socket path to create and hand to the server
	int fd;               // inherited listening socket; -1: none (use listen)
	const char *env_file; // NUL-separated K=V entries for the server, read once and removed; NULL: none
	char **server;        // server argv, NULL-terminated
	int nserver;
};

// pending is a connection init accepted while no server ran.
struct pending {
	int active;
	int fd;
	int64_t deadline; // for its first bytes, then for a GET /health's head
	int watched;
	int health; // a GET /health whose head init reads: init answers it
	size_t len; // what of that head arrived
	char head[head_max + 1024];
};

// supervisor starts the server on demand and reaps every process.
struct supervisor {
	struct config cfg;
	int lfd;
	char **env; // the server's environment; NULL: init's own
	int ep;     // the epoll set
	int sfd;    // the signalfd
	int lsn;    // lfd is in the epoll set

	int64_t retry_at; // no accept before then (backoff); 0: none
	struct pending pend;

	pid_t pid; // the running server; 0 when none
	int64_t started;
	int held;      // init's copy of the connection the server started with, until it serves; -1: none
	int ready;     // the read end of the server's ready pipe until it reports; -1: none
	int not_ready; // the server closed its ready pipe without the byte
	int failures;  // consecutive failed starts
	// failure says why no server can serve (the agent binary failed the
	// boot check, or the last start failed); /health answers 503 with it.
	// Empty once a server serves.
	char failure[msg_max];
	int terminating;
	int exit_code;
};

static struct supervisor s;

// now_ms is CLOCK_MONOTONIC in ms.
static int64_t now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// errstr is strerror's text (init never sets a locale: the C one) as Go's
// errors print it, with a lowercase first letter.
static const char *errstr(int e) {
	static char buf[128];
	snprintf(buf, sizeof buf, "%s", strerror(e));
	if (buf[0] >= 'A' && buf[0] <= 'Z' && !(buf[1] >= 'A' && buf[1] <= 'Z')) {
		buf[0] = (char)(buf[0] - 'A' + 'a');
	}
	return buf;
}

// sigstr is a signal's description as Go's syscall.Signal prints it.
static const char *sigstr(int sig) {
	static char buf[64];
	snprintf(buf, sizeof buf, "%s", strsignal(sig));
	if (buf[0] >= 'A' && buf[0] <= 'Z') {
		buf[0] = (char)(buf[0] - 'A' + 'a');
	}
	return buf;
}

// logmsg writes one line to stderr (the sandbox's agent log) with one
// write(2); an EPIPE is dropped (SIGPIPE does not end init: see
// catch_signals).
__attribute__((format(printf, 1, 2))) static void logmsg(const char *fmt, ...) {
	char buf[msg_max + 64];
	int n = snprintf(buf, sizeof buf, "opendsec-init: ");
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (m < 0) {
		m = 0;
	}
	n += m;
	if ((size_t)n > sizeof buf - 2) {
		n = (int)sizeof buf - 2;
	}
	buf[n++] = '\n';
	ssize_t w;
	do {
		w = write(2, buf, (size_t)n);
	} while (w < 0 && errno == EINTR);
}

// duration formats ms as Go's time.Duration prints a value rounded to ms.
static void duration(char *buf, size_t size, int64_t ms) {
	if (ms == 0) {
		snprintf(buf, size, "0s");
		return;
	}
	if (ms < 1000) {
		snprintf(buf, size, "%lldms", (long long)ms);
		return;
	}
	int64_t h = ms / 3600000, m = ms / 60000 % 60, sec = ms / 1000 % 60, frac = ms % 1000;
	size_t n = 0;
	if (h > 0) {
		n += (size_t)snprintf(buf + n, size - n, "%lldh", (long long)h);
	}
	if (h > 0 || m > 0) {
		n += (size_t)snprintf(buf + n, size - n, "%lldm", (long long)m);
	}
	if (frac == 0) {
		snprintf(buf + n, size - n, "%llds", (long long)sec);
		return;
	}
	char f[8];
	snprintf(f, sizeof f, "%03lld", (long long)frac);
	for (int i = 2; i > 0 && f[i] == '0'; i--) {
		f[i] = 0;
	}
	snprintf(buf + n, size - n, "%lld.%ss", (long long)sec, f);
}

// parse_args fills cfg from argv, or writes why not into err.
static int parse_args(int argc, char **argv, struct config *c, char *err, size_t size) {
	memset(c, 0, sizeof *c);
	c->fd = -1;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--") == 0) {
			c->server = argv + i + 1;
			c->nserver = argc - i - 1;
			break;
		}
		if (strcmp(a, "--seccomp-filter") == 0 || strcmp(a, "--listen") == 0 || strcmp(a, "--listen-fd") == 0 ||
		    strcmp(a, "--env-file") == 0) {
			if (i + 1 >= argc || argv[i + 1][0] == 0) {
				snprintf(err, size, "%s needs a value", a);
				return -1;
			}
			const char *v = argv[++i];
			if (strcmp(a, "--listen") == 0) {
				c->listen = v;
			} else if (strcmp(a, "--env-file") == 0) {
				c->env_file = v;
			} else if (strcmp(a, "--listen-fd") == 0) {
				char *end;
				errno = 0;
				long n = strtol(v, &end, 10);
				if (errno != 0 || *end != 0 || n < 3 || n > INT_MAX) {
					snprintf(err, size, "--listen-fd: %s is not a file descriptor number of 3 or more", v);
					return -1;
				}
				c->fd = (int)n;
			} else {
				c->seccomp = v;
			}
			continue;
		}
		if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
			snprintf(err, size, "help requested");
			return -1;
		}
		snprintf(err, size, "unknown argument %s; put the server's command after --", a);
		return -1;
	}
	if (c->listen != NULL && c->fd >= 0) {
		snprintf(err, size, "--listen and --listen-fd: give one, not both");
	} else if (c->listen == NULL && c->fd < 0) {
		snprintf(err, size, "--listen: missing; give the unix socket path the node dials (or --listen-fd)");
	} else if (c->fd < 0 && c->listen[0] != '/') {
		snprintf(err, size, "--listen: %s is not absolute; give an absolute socket path", c->listen);
	} else if (c->nserver == 0 || c->server[0][0] == 0) {
		snprintf(err, size, "server: missing; give its command after --, e.g. -- /.opendsec/agent");
	} else {
		return 0;
	}
	return -1;
}

// read_file reads all of path into a malloc'd buffer (*len bytes, NUL
// after them); -1 with errno set on failure, *op the step that failed.
static char *read_file(const char *path, size_t *len, const char **op) {
	*op = "open";
	int fd;
	do {
		fd = open(path, O_RDONLY | O_CLOEXEC);
	} while (fd < 0 && errno == EINTR);
	if (fd < 0) {
		return NULL;
	}
	*op = "read";
	size_t cap = 4096, n = 0;
	char *b = malloc(cap + 1);
	if (b == NULL) {
		close(fd);
		errno = ENOMEM;
		return NULL;
	}
	for (;;) {
		if (n == cap) {
			char *nb = realloc(b, cap * 2 + 1);
			if (nb == NULL) {
				free(b);
				close(fd);
				errno = ENOMEM;
				return NULL;
			}
			b = nb;
			cap *= 2;
		}
		ssize_t r = read(fd, b + n, cap - n);
		if (r < 0 && errno == EINTR) {
			continue;
		}
		if (r < 0) {
			int e = errno;
			free(b);
			close(fd);
			errno = e;
			return NULL;
		}
		if (r == 0) {
			break;
		}
		n += (size_t)r;
	}
	close(fd);
	b[n] = 0;
	*len = n;
	return b;
}

// install_seccomp installs the compiled filter at path (the kernel's
// struct sock_filter array) with no_new_privs: nothing in the sandbox runs
// without it, init included.
static int install_seccomp(const char *path) {
	size_t n;
	const char *op;
	char *b = read_file(path, &n, &op);
	if (b == NULL) {
		logmsg("read seccomp filter: %s %s: %s", op, path, errstr(errno));
		return -1;
	}
	if (n == 0 || n % 8 != 0 || n / 8 > 4096) {
		logmsg("seccomp filter %s: %zu bytes is not 1 to 4096 8-byte instructions", path, n);
		free(b);
		return -1;
	}
	struct bpf_prog_hdr prog = {.len = (unsigned short)(n / 8), .filter = (struct bpf_insn8 *)(void *)b};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
		logmsg("set no_new_privs: %s", errstr(errno));
		free(b);
		return -1;
	}
	// One thread: no TSYNC needed.
	if (syscall(SYS_seccomp, seccomp_set_mode_filter, 0, &prog) != 0) {
		logmsg("install seccomp filter: %s", errstr(errno));
		free(b);
		return -1;
	}
	free(b);
	return 0;
}

// inherit_listener checks that fd is a listening unix stream socket and
// moves it to a close-on-exec descriptor above the standard ones: only the
// server gets it, as fd 3, never a process the server starts.
static int inherit_listener(int fd) {
	int v;
	socklen_t l = sizeof v;
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &l) != 0) {
		logmsg("--listen-fd %d: not a socket: %s", fd, errstr(errno));
		return -1;
	}
	if (v != AF_UNIX) {
		logmsg("--listen-fd %d: not a unix socket", fd);
		return -1;
	}
	l = sizeof v;
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &v, &l) != 0 || v != SOCK_STREAM) {
		logmsg("--listen-fd %d: not a stream socket", fd);
		return -1;
	}
	l = sizeof v;
	if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &l) != 0 || v != 1) {
		logmsg("--listen-fd %d: not listening; listen(2) before handing it over", fd);
		return -1;
	}
	int nfd = fcntl(fd, F_DUPFD_CLOEXEC, 10);
	if (nfd < 0) {
		logmsg("--listen-fd %d: dup: %s", fd, errstr(errno));
		return -1;
	}
	close(fd);
	return nfd;
}

// mkdir_all makes dir and its parents (mode 0755).
static int mkdir_all(const char *dir) {
	char p[PATH_MAX];
	if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) {
		errno = ENAMETOOLONG;
		return -1;
	}
	for (char *c = p + 1;; c++) {
		if (*c == '/' || *c == 0) {
			char was = *c;
			*c = 0;
			if (mkdir(p, 0755) != 0 && errno != EEXIST) {
				return -1;
			}
			*c = was;
			if (was == 0) {
				break;
			}
		}
	}
	struct stat st;
	if (stat(p, &st) != 0) {
		return -1;
	}
	if (!S_ISDIR(st.st_mode)) {
		errno = ENOTDIR;
		return -1;
	}
	return 0;
}

// listen_unix creates the listening socket at path (replacing a stale one).
// It is close-on-exec: only the server gets it, as fd 3.
static int listen_unix(const char *path) {
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof sa.sun_path) {
		logmsg("bind %s: the path is longer than %zu bytes; pick a shorter --listen", path, sizeof sa.sun_path - 1);
		return -1;
	}
	strcpy(sa.sun_path, path);
	char dir[PATH_MAX];
	snprintf(dir, sizeof dir, "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash != NULL && slash != dir) {
		*slash = 0;
		if (mkdir_all(dir) != 0) {
			logmsg("make socket directory: mkdir %s: %s", dir, errstr(errno));
			return -1;
		}
	}
	struct stat st;
	if (lstat(path, &st) == 0) {
		if (!S_ISSOCK(st.st_mode)) {
			logmsg("listen: %s exists and is not a socket; remove it or pick another --listen", path);
			return -1;
		}
		if (unlink(path) != 0) {
			logmsg("remove stale socket: remove %s: %s", path, errstr(errno));
			return -1;
		}
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		logmsg("make socket: %s", errstr(errno));
		return -1;
	}
	if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
		logmsg("bind %s: %s", path, errstr(errno));
		close(fd);
		return -1;
	}
	if (listen(fd, listen_backlog) != 0) {
		logmsg("listen on %s: %s", path, errstr(errno));
		close(fd);
		return -1;
	}
	return fd;
}

// quote writes s as a double-quoted string with non-printing bytes escaped.
static void quote(char *buf, size_t size, const char *s) {
	size_t n = 0;
	if (size < 8) {
		return;
	}
	buf[n++] = '"';
	for (; *s && n + 6 < size; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') {
			buf[n++] = '\\';
			buf[n++] = (char)c;
		} else if (c < 0x20 || c >= 0x7f) {
			n += (size_t)snprintf(buf + n, size - n, "\\x%02x", c);
		} else {
			buf[n++] = (char)c;
		}
	}
	buf[n++] = '"';
	buf[n] = 0;
}

// server_env_from_file returns the server's environment from the env file
// when there is one (it is removed once read: it may hold secrets): a
// NULL-terminated array, empty when the file has no entry; NULL when there
// is no file (the server gets init's own) or *failed is set.
static char **server_env_from_file(const char *path, int *failed) {
	*failed = 0;
	if (path == NULL) {
		return NULL;
	}
	size_t n;
	const char *op;
	char *b = read_file(path, &n, &op);
	if (b == NULL && errno == ENOENT && strcmp(op, "open") == 0) {
		return NULL;
	}
	*failed = 1;
	if (b == NULL) {
		logmsg("read --env-file: %s %s: %s", op, path, errstr(errno));
		return NULL;
	}
	if (unlink(path) != 0) {
		logmsg("remove --env-file: remove %s: %s", path, errstr(errno));
		free(b);
		return NULL;
	}
	size_t count = 0;
	for (size_t i = 0; i < n; i++) {
		count += b[i] == 0;
	}
	char **env = calloc(count + 2, sizeof *env);
	if (env == NULL) {
		logmsg("read --env-file: %s", errstr(ENOMEM));
		free(b);
		return NULL;
	}
	size_t k = 0;
	for (char *e = b; e < b + n; e += strlen(e) + 1) {
		if (*e == 0) {
			continue;
		}
		if (strchr(e, '=') == NULL) {
			char q[512];
			quote(q, sizeof q, e);
			logmsg("--env-file %s: entry %s is not K=V", path, q);
			free(env);
			free(b);
			return NULL;
		}
		env[k++] = e; // b stays allocated for the process's life
	}
	env[k] = NULL;
	*failed = 0;
	return env;
}

// server_env is the environment a server starts with.
static char **server_env(void) { return s.env != NULL ? s.env : environ; }

// check_server writes into s.failure why the server binary at path cannot
// run (nothing when it looks fine): it must be executable and start like an
// ELF binary or a script. One access and one 4-byte read at boot, instead
// of starting the agent only to see it answer.
static void check_server(const char *path) {
	if (access(path, X_OK) != 0) {
		snprintf(s.failure, sizeof s.failure, "the agent (%s) cannot run: %s", path, errstr(errno));
		return;
	}
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		snprintf(s.failure, sizeof s.failure, "the agent (%s) cannot be read: %s", path, errstr(errno));
		return;
	}
	char b[4];
	ssize_t n = read(fd, b, sizeof b);
	close(fd);
	if (n < 2 || (memcmp(b, "#!", 2) != 0 && (n < 4 || memcmp(b, "\x7f" "ELF", 4) != 0))) {
		snprintf(s.failure, sizeof s.failure, "the agent (%s) is not an executable (no ELF or #! header)", path);
	}
}

// watch adds fd to the epoll set (level-triggered, for reading) or removes
// it. A watched fd must be removed before init closes it or hands it to the
// server: a copy in another process would keep it in the set.
static int watch(int fd, int on) {
	struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
	if (epoll_ctl(s.ep, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, fd, &ev) != 0) {
		int e = errno;
		logmsg("%s %d: %s", on ? "watch" : "unwatch", fd, errstr(e));
		errno = e; // for the caller's message
		return -1;
	}
	return 0;
}

// drain reads and drops what is waiting on fd, without waiting for more
// (at most 1 MiB: a client still sending a body after that gets a reset).
static void drain(int fd) {
	char buf[4096];
	for (size_t total = 0; total < (1u << 20);) {
		ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR) {
			continue;
		}
		if (n <= 0) {
			return;
		}
		total += (size_t)n;
	}
}

// answer writes init's own answer on fd and closes it: 204 when failure is
// empty (the answer the agent gives to GET /health), else 503 with envd's
// error body naming the failure.
static void answer(int fd, const char *proto, const char *failure) {
	static const char common[] =
	    "Cache-Control: no-store\r\nAccess-Control-Allow-Origin: *\r\nConnection: close\r\n";
	static char msg[6 * msg_max + 1024];
	static char body[6 * msg_max + 64];
	if (proto == NULL) {
		proto = "HTTP/1.1";
	}
	int len;
	if (failure[0] == 0) {
		len = snprintf(msg, sizeof msg, "%s 204 No Content\r\n%s\r\n", proto, common);
	} else {
		// envd's error body: {"code":503,"message":"opendsec-init: ..."},
		// the message as a JSON string.
		size_t n = (size_t)snprintf(body, sizeof body, "{\"code\":503,\"message\":\"opendsec-init: ");
		static const char hex[] = "0123456789abcdef";
		for (const char *p = failure; *p && n + 8 < sizeof body; p++) {
			unsigned char c = (unsigned char)*p;
			if (c == '"' || c == '\\') {
				body[n++] = '\\';
				body[n++] = (char)c;
			} else if (c < 0x20) {
				memcpy(body + n, "\\u00", 4);
				n += 4;
				body[n++] = hex[c >> 4];
				body[n++] = hex[c & 15];
			} else {
				body[n++] = (char)c;
			}
		}
		body[n++] = '"';
		body[n++] = '}';
		body[n] = 0;
		len = snprintf(msg, sizeof msg,
		               "%s 503 Service Unavailable\r\n%sContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
		               proto, common, n, body);
	}
	if (len < 0 || (size_t)len >= sizeof msg) {
		len = (int)strlen(msg);
	}
	// A few hundred bytes into an empty socket buffer: this does not block
	// unless the peer stopped reading altogether, which SO_SNDTIMEO bounds.
	struct timeval tv = {.tv_sec = peek_timeout / 1000, .tv_usec = (peek_timeout % 1000) * 1000};
	(void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	// The request (or what of it arrived) is taken first: a unix socket
	// closed with unread data resets the peer, which may then lose the
	// answer.
	drain(fd);
	for (const char *p = msg; len > 0;) {
		ssize_t n = send(fd, p, (size_t)len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR) {
			continue;
		}
		if (n <= 0) {
			break;
		}
		p += n;
		len -= (int)n;
	}
	(void)shutdown(fd, SHUT_WR);
	drain(fd);
	close(fd);
}

static int64_t backoff(void) {
	int shift = s.failures - 1;
	if (shift > 10) {
		shift = 10;
	}
	if (shift < 0) {
		shift = 0;
	}
	int64_t d = (int64_t)min_backoff << shift;
	return d < max_backoff ? d : max_backoff;
}

// backoff_next: no accept for the next backoff delay.
static void backoff_next(void) { s.retry_at = now_ms() + backoff(); }

// served: the server said it serves; the connection it started with is its
// alone now (init's copy would keep the peer from ever seeing EOF).
static void served(void) {
	s.failure[0] = 0;
	if (s.held >= 0) {
		close(s.held);
		s.held = -1;
	}
}

static void close_ready(void) {
	if (s.ready >= 0) {
		(void)watch(s.ready, 0);
		close(s.ready);
		s.ready = -1;
	}
}

// read_ready takes the server's report on its ready pipe: the byte (it
// serves), or the pipe closed without it.
static void read_ready(void) {
	char b;
	ssize_t n = read(s.ready, &b, 1);
	if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
		return; // epoll says again
	}
	close_ready();
	if (n == 1) {
		served();
	} else {
		s.not_ready = 1;
	}
}

// served_before_exit tells, for a server that exited holding init's
// connection, whether it served (reported ready) first: the report may
// still be in the pipe, not yet taken by the loop.
static int served_before_exit(void) {
	if (s.ready >= 0) {
		int64_t deadline = now_ms() + ready_grace;
		for (int64_t left = ready_grace; left > 0; left = deadline - now_ms()) {
			struct pollfd p = {.fd = s.ready, .events = POLLIN};
			int n = poll(&p, 1, (int)left + 1);
			if (n < 0 && errno == EINTR) {
				continue;
			}
			if (n > 0) {
				read_ready();
			}
			break;
		}
	}
	return s.held < 0;
}

// start runs the server for the connection conn. Init keeps a copy of conn
// until the server reports on ready_fd, so that a server that dies before
// serving gets its reason written to that connection instead of a bare EOF.
// On failure it writes why into err.
static int start(int conn, char *err, size_t size) {
	int p[2], ep[2];
	if (pipe2(p, O_CLOEXEC) != 0) {
		snprintf(err, size, "make ready pipe: %s", errstr(errno));
		return -1;
	}
	// The child reports a failed exec's errno on ep (closed by a good exec).
	if (pipe2(ep, O_CLOEXEC) != 0) {
		snprintf(err, size, "make exec report pipe: %s", errstr(errno));
		close(p[0]);
		close(p[1]);
		return -1;
	}
	int n = s.cfg.nserver;
	char **argv = calloc((size_t)n + 7, sizeof *argv);
	if (argv == NULL) {
		snprintf(err, size, "start server %s: %s", s.cfg.server[0], errstr(ENOMEM));
		close(p[0]);
		close(p[1]);
		close(ep[0]);
		close(ep[1]);
		return -1;
	}
	memcpy(argv, s.cfg.server, (size_t)n * sizeof *argv);
	argv[n] = "--listen-fd";
	argv[n + 1] = "3";
	argv[n + 2] = "--conn-fd";
	argv[n + 3] = "4";
	argv[n + 4] = "--ready-fd";
	argv[n + 5] = "5";
	argv[n + 6] = NULL;
	char **env = server_env();
	pid_t pid = fork();
	if (pid == 0) {
		// The child: the three fds to 3, 4, 5 (each first moved above 5,
		// close-on-exec, so no dup2 overwrites another's source), the
		// signal mask init blocks for its signalfd cleared; caught
		// signals are back to their default with the exec.
		int src[3] = {s.lfd, conn, p[1]};
		int e = 0;
		for (int i = 0; i < 3 && e == 0; i++) {
			src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 6);
			if (src[i] < 0) {
				e = errno;
			}
		}
		for (int i = 0; i < 3 && e == 0; i++) {
			if (dup2(src[i], 3 + i) < 0) {
				e = errno;
			}
		}
		sigset_t none;
		sigemptyset(&none);
		if (e == 0 && sigprocmask(SIG_SETMASK, &none, NULL) != 0) {
			e = errno;
		}
		if (e == 0) {
			execve(argv[0], argv, env);
			e = errno;
		}
		while (write(ep[1], &e, sizeof e) < 0 && errno == EINTR) {
		}
		_exit(127);
	}
	int fe = errno;
	free(argv);
	close(p[1]);
	close(ep[1]);
	if (pid < 0) {
		close(p[0]);
		close(ep[0]);
		snprintf(err, size, "start server %s: fork: %s", s.cfg.server[0], errstr(fe));
		return -1;
	}
	int e = 0;
	ssize_t r;
	do {
		r = read(ep[0], &e, sizeof e);
	} while (r < 0 && errno == EINTR);
	close(ep[0]);
	if (r == (ssize_t)sizeof e) {
		// The exec failed: the child is gone (reaped here; its SIGCHLD
		// then finds nothing).
		while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
		}
		close(p[0]);
		snprintf(err, size, "start server %s: %s", s.cfg.server[0], errstr(e));
		return -1;
	}
	if (watch(p[0], 1) != 0) {
		kill(pid, SIGKILL); // reaped with the next SIGCHLD
		close(p[0]);
		snprintf(err, size, "start server %s: watch ready pipe: %s", s.cfg.server[0], errstr(errno));
		return -1;
	}
	s.pid = pid;
	s.started = now_ms();
	s.held = conn;
	s.ready = p[0];
	s.not_ready = 0;
	return 0;
}

static void describe(char *buf, size_t size, int ws) {
	if (WIFEXITED(ws)) {
		snprintf(buf, size, "exited with status %d", WEXITSTATUS(ws));
	} else {
		snprintf(buf, size, "killed by %s", sigstr(WTERMSIG(ws)));
	}
}

static int exit_code(int ws) { return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws); }

// reap collects every exited child. When the server is among them it says
// whether init is done, and when init accepts again.
static int reap(void) {
	for (;;) {
		int ws;
		pid_t pid = waitpid(-1, &ws, WNOHANG);
		if (pid < 0 && errno == EINTR) {
			continue;
		}
		if (pid <= 0) {
			return 0;
		}
		if (pid != s.pid) {
			continue; // an orphan
		}
		s.pid = 0;
		char how[128], d[64], next[64];
		describe(how, sizeof how, ws);
		int64_t ran = now_ms() - s.started;
		duration(d, sizeof d, ran);
		int never_served = s.held >= 0 && (s.not_ready || !served_before_exit());
		close_ready();
		if (s.terminating) {
			if (s.held >= 0) {
				close(s.held);
				s.held = -1;
			}
			s.exit_code = exit_code(ws);
			return 1;
		}
		if (never_served) {
			s.failures++;
			backoff_next();
			snprintf(s.failure, sizeof s.failure,
			         "the agent (%s) %s after %s before serving; the sandbox's agent log has its reason",
			         s.cfg.server[0], how, d);
			answer(s.held, NULL, s.failure);
			s.held = -1;
			duration(next, sizeof next, backoff());
			logmsg("server %s after %s before serving (failure %d); next start in %s", how, d, s.failures, next);
		} else if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) {
			s.failures = 0;
			s.retry_at = 0;
		} else if (ran < start_window) {
			s.failures++;
			backoff_next();
			duration(next, sizeof next, backoff());
			logmsg("server %s after %s (failure %d); next start in %s", how, d, s.failures, next);
		} else {
			s.failures = 0;
			s.retry_at = 0;
			logmsg("server %s; it starts again on the next connection", how);
		}
	}
}

// signals handles the signals caught; 1: init exits with s.exit_code.
static int signals(void) {
	struct signalfd_siginfo si[16];
	int chld = 0;
	for (;;) {
		ssize_t n = read(s.sfd, si, sizeof si);
		if (n < 0 && errno == EINTR) {
			continue;
		}
		if (n <= 0) {
			break;
		}
		for (size_t i = 0; i < (size_t)n / sizeof si[0]; i++) {
			int sig = (int)si[i].ssi_signo;
			if (sig == SIGCHLD) {
				chld = 1;
				continue;
			}
			// SIGTERM, SIGINT: the server ends its processes and exits;
			// init follows.
			s.terminating = 1;
			if (s.pid == 0) {
				return 1;
			}
			kill(s.pid, sig);
		}
	}
	return chld ? reap() : 0;
}

static void drop_pending(void) {
	if (s.pend.watched) {
		(void)watch(s.pend.fd, 0);
	}
	s.pend.active = 0;
}

// watch_pending puts the pending connection in the epoll set: it has no
// unread bytes (level-triggered, it would be ready at once otherwise).
static void watch_pending(void) {
	if (s.pend.watched) {
		return;
	}
	if (watch(s.pend.fd, 1) != 0) {
		s.pend.deadline = now_ms(); // decided without waiting
		return;
	}
	s.pend.watched = 1;
}

// to_server hands the pending connection to a new server.
static void to_server(void) {
	int fd = s.pend.fd;
	drop_pending();
	if (s.terminating || s.pid != 0) {
		close(fd);
		return;
	}
	char err[msg_max];
	if (start(fd, err, sizeof err) != 0) {
		s.failures++;
		snprintf(s.failure, sizeof s.failure, "the agent cannot start: %s", err);
		logmsg("%s", err);
		answer(fd, NULL, s.failure);
		backoff_next();
	}
}

// classify looks at the pending connection's first bytes without taking
// them (MSG_PEEK), so that any request but GET /health reaches the server
// untouched; a GET /health has its head read here, for init to answer.
// Nothing waits: with no bytes yet the connection joins the epoll set until
// they come or its deadline passes (timed_out). A connection that sends
// nothing in time goes to the server; one closed before sending anything
// starts nothing.
static void classify(int timed_out) {
	struct pending *c = &s.pend;
	if (!c->health) {
		char buf[sizeof health_prefix]; // the prefix and one byte more
		ssize_t n;
		do {
			n = recv(c->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
		} while (n < 0 && errno == EINTR);
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !timed_out) {
			watch_pending();
			return;
		}
		if (n < 0) { // nothing in time: the server decides
			to_server();
			return;
		}
		if (n == 0) {
			drop_pending();
			close(c->fd);
			return;
		}
		size_t pl = sizeof health_prefix - 1;
		if ((size_t)n < sizeof buf || memcmp(buf, health_prefix, pl) != 0 || (buf[pl] != ' ' && buf[pl] != '?')) {
			to_server();
			return;
		}
		// The head gets its own peek_timeout: a client dribbling bytes
		// holds init's accept no longer.
		c->health = 1;
		c->deadline = now_ms() + peek_timeout;
		timed_out = 0;
	}
	while (c->len < head_max && memmem(c->head, c->len, "\r\n\r\n", 4) == NULL) {
		ssize_t n = recv(c->fd, c->head + c->len, 1024, MSG_DONTWAIT);
		if (n < 0 && errno == EINTR) {
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !timed_out) {
			watch_pending();
			return;
		}
		if (n <= 0) {
			break;
		}
		c->len += (size_t)n;
	}
	drop_pending();
	const char *proto = NULL;
	char *eol = memmem(c->head, c->len, "\r\n", 2);
	size_t ll = eol != NULL ? (size_t)(eol - c->head) : c->len;
	if (ll >= 9 && memcmp(c->head + ll - 9, " HTTP/1.0", 9) == 0) {
		proto = "HTTP/1.0";
	}
	answer(c->fd, proto, s.failure);
}

// accept_one takes one connection: only init accepts meanwhile, no server
// runs.
static void accept_one(void) {
	// The socket is non-blocking: EAGAIN is a connection gone meanwhile.
	int fd = accept4(s.lfd, NULL, NULL, SOCK_CLOEXEC);
	if (fd < 0) {
		if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
			logmsg("accept: %s", errstr(errno));
			s.retry_at = now_ms() + 1000; // never spin on a broken socket
		}
		return;
	}
	s.pend.active = 1;
	s.pend.fd = fd;
	s.pend.deadline = now_ms() + peek_timeout;
	s.pend.watched = 0;
	s.pend.health = 0;
	s.pend.len = 0;
	classify(0); // the request is usually there already
}

// set_listen puts the listening socket in the epoll set or takes it out.
static int set_listen(int on) {
	if (on == s.lsn) {
		return 0;
	}
	if (watch(s.lfd, on) != 0) {
		return -1;
	}
	s.lsn = on;
	return 0;
}

// loop runs until init is done.
static int loop(void) {
	struct epoll_event evs[8];
	for (;;) {
		// Init accepts only while no server runs (the server accepts
		// then), one connection at a time, and not during a backoff.
		if (set_listen(s.pid == 0 && !s.terminating && !s.pend.active && s.retry_at == 0) != 0) {
			return 1;
		}
		int64_t deadline = s.retry_at;
		if (s.pend.active && (deadline == 0 || s.pend.deadline < deadline)) {
			deadline = s.pend.deadline;
		}
		int timeout = -1;
		if (deadline != 0) {
			int64_t left = deadline - now_ms();
			timeout = left < 0 ? 0 : (int)left;
		}
		int n = epoll_pwait(s.ep, evs, 8, timeout, NULL);
		if (n < 0 && errno != EINTR) {
			logmsg("epoll_wait: %s", errstr(errno));
			return 1;
		}
		for (int i = 0; i < n; i++) {
			// Each handler is non-blocking and checks the fd against the
			// current state: an earlier one may have closed it.
			int fd = evs[i].data.fd;
			if (fd == s.sfd) {
				if (signals()) {
					return s.exit_code;
				}
			} else if (fd == s.lfd && s.lsn) {
				accept_one();
			} else if (s.pend.active && fd == s.pend.fd) {
				classify(0);
			} else if (fd == s.ready) {
				read_ready();
			}
		}
		int64_t now = now_ms();
		if (s.retry_at != 0 && now >= s.retry_at) {
			s.retry_at = 0;
		}
		if (s.pend.active && now >= s.pend.deadline) {
			classify(1);
		}
	}
}

static void on_signal(int sig) { (void)sig; }

// catch_signals takes SIGCHLD, SIGTERM and SIGINT through a signalfd
// (blocked, with a handler that never runs: a blocked signal is queued for
// a namespace's init whatever its disposition, and the handler shows in
// SigCgt). The others that would end init when sent by a process (a root
// process's kill -HUP 1): as PID 1 of a PID namespace (every sandbox's
// init) at SIG_DFL, which the kernel drops for a namespace's init, from
// inside and from outside the namespace (pid_namespaces(7); SIGKILL and
// SIGSTOP from an ancestor aside; a fault of init itself still ends it);
// not PID 1 (tests, or a host without PID namespaces) caught with a
// handler that does nothing. Caught, not ignored: an ignored signal stays
// ignored across exec, in the server and every process it starts; a caught
// one is back to its default in the child.
static int catch_signals(int pid1) {
	static const int stray[] = {SIGHUP,  SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGVTALRM,
	                            SIGSTKFLT, SIGXCPU, SIGXFSZ, SIGIO, SIGPWR,  SIGSYS,  SIGTRAP,
	                            SIGABRT, SIGILL,  SIGBUS,  SIGFPE,  SIGSEGV};
	struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};
	sigemptyset(&sa.sa_mask);
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigemptyset(&dfl.sa_mask);
	for (size_t i = 0; i < sizeof stray / sizeof stray[0]; i++) {
		if (sigaction(stray[i], pid1 ? &dfl : &sa, NULL) != 0) {
			logmsg("signal %d: %s", stray[i], errstr(errno));
			return -1;
		}
	}
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	if (sigprocmask(SIG_BLOCK, &set, NULL) != 0) {
		logmsg("block signals: %s", errstr(errno));
		return -1;
	}
	for (int sig = 0; sig < 3; sig++) {
		if (sigaction((int[]){SIGCHLD, SIGTERM, SIGINT}[sig], &sa, NULL) != 0) {
			logmsg("signal: %s", errstr(errno));
			return -1;
		}
	}
	s.sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
	if (s.sfd < 0) {
		logmsg("signalfd: %s", errstr(errno));
		return -1;
	}
	return 0;
}

int main(int argc, char **argv) {
	char err[msg_max];
	if (parse_args(argc, argv, &s.cfg, err, sizeof err) != 0) {
		logmsg("%s\n%s", err, usage);
		return 2;
	}
	// First: nothing in the sandbox may run without its filter, init
	// included.
	if (s.cfg.seccomp != NULL && install_seccomp(s.cfg.seccomp) != 0) {
		return 1;
	}
	s.lfd = s.cfg.fd >= 0 ? inherit_listener(s.cfg.fd) : listen_unix(s.cfg.listen);
	if (s.lfd < 0) {
		return 1;
	}
	int failed;
	s.env = server_env_from_file(s.cfg.env_file, &failed);
	if (failed) {
		return 1;
	}
	// Like the agent was as PID 1: the OOM killer takes a user process
	// before init (it fails quietly without CAP_SYS_RESOURCE).
	int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_TRUNC | O_CLOEXEC);
	if (oom >= 0) {
		(void)!write(oom, "-1000", 5);
		close(oom);
	}
	// The socket is non-blocking for init's accept (it is anyway once a
	// server took it: Go's net.FileListener sets that on the shared file
	// description).
	int fl = fcntl(s.lfd, F_GETFL);
	if (fl < 0 || fcntl(s.lfd, F_SETFL, fl | O_NONBLOCK) != 0) {
		logmsg("listening socket: %s", errstr(errno));
		return 1;
	}
	if (catch_signals(getpid() == 1) != 0) {
		return 1;
	}
	s.ep = epoll_create1(EPOLL_CLOEXEC);
	if (s.ep < 0) {
		logmsg("epoll_create1: %s", errstr(errno));
		return 1;
	}
	if (watch(s.sfd, 1) != 0) {
		return 1;
	}
	s.held = -1;
	s.ready = -1;
	// No server at boot: init answers the node's first GET /health itself
	// (see classify), and the server starts with the first real request. A
	// missing or non-executable agent is caught here, at no cost, and
	// reported by that /health answer.
	check_server(s.cfg.server[0]);
	if (s.failure[0] != 0) {
		logmsg("%s", s.failure);
	}
	return loop();
}
