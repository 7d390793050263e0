/*
 * libsystemd.so.0 for crun, without systemd: every function crun 1.8 on
 * Debian takes from libsystemd, none doing anything (the int ones return
 * -ENOSYS, the unref ones NULL). crun needs them only for what the node
 * never asks of it (the systemd cgroup manager and sd-bus, journald
 * logging, the notify socket); Debian's libsystemd costs each crun
 * command five more libraries to load and relocate (libgcrypt, liblzma,
 * libzstd, liblz4, libgpg-error) and ~0.6 ms of CPU. The node preloads
 * this one into crun (LD_PRELOAD, ociruntime_linux.go) only when crun's
 * imports from libsystemd are all here. No libc: nothing here calls one.
 *
 * Built by scripts/build-init.sh next to opendsec-init, with the version
 * script libsystemd.map (crun's imports are versioned).
 */
#define ENOSYS_ 38
#define STUB(name) int name(void) { return -ENOSYS_; }
#define UNREF(name) void *name(void *p) { (void)p; return 0; }

STUB(sd_journal_send_with_location)
STUB(sd_notify)
STUB(sd_notify_barrier)
STUB(sd_bus_call)
STUB(sd_bus_default_system)
STUB(sd_bus_default_user)
STUB(sd_bus_error_get_errno)
STUB(sd_bus_match_signal_async)
STUB(sd_bus_message_append)
STUB(sd_bus_message_append_strv)
STUB(sd_bus_message_close_container)
STUB(sd_bus_message_new_method_call)
STUB(sd_bus_message_open_container)
STUB(sd_bus_message_read)
STUB(sd_bus_process)
STUB(sd_bus_wait)
UNREF(sd_bus_message_unref)
UNREF(sd_bus_unref)
void sd_bus_error_free(void *e) { (void)e; }
