package agent

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// user is a sandbox account, read from the sandbox's own /etc/passwd and
// /etc/group on every request (users may be added while the sandbox runs).
type user struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary
	Home   string
}

// users resolves names and ids against passwd and group files in dir.
type users struct{ dir string }

type passwdEntry struct {
	name     string
	uid, gid uint32
	home     string
}

type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

func (u users) passwd() []passwdEntry {
	var out []passwdEntry
	readColon(filepath.Join(u.dir, "passwd"), func(f []string) {
		if len(f) < 6 {
			return
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			return
		}
		out = append(out, passwdEntry{name: f[0], uid: uint32(uid), gid: uint32(gid), home: f[5]})
	})
	return out
}

func (u users) groups() []groupEntry {
	var out []groupEntry
	readColon(filepath.Join(u.dir, "group"), func(f []string) {
		if len(f) < 3 {
			return
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return
		}
		g := groupEntry{name: f[0], gid: uint32(gid)}
		if len(f) > 3 && f[3] != "" {
			g.members = strings.Split(f[3], ",")
		}
		out = append(out, g)
	})
	return out
}

func readColon(path string, fn func([]string)) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		fn(strings.Split(line, ":"))
	}
}

// lookup returns the named user. root always exists (uid 0, home /root) so
// images without /etc/passwd still work.
func (u users) lookup(name string) (*user, error) {
	for _, p := range u.passwd() {
		if p.name != name {
			continue
		}
		usr := &user{Name: p.name, UID: p.uid, GID: p.gid, Home: p.home}
		for _, g := range u.groups() {
			if g.gid == p.gid {
				continue
			}
			for _, m := range g.members {
				if m == name {
					usr.Groups = append(usr.Groups, g.gid)
					break
				}
			}
		}
		if usr.Home == "" {
			usr.Home = "/"
		}
		return usr, nil
	}
	if name == "root" {
		return &user{Name: "root", Home: "/root"}, nil
	}
	return nil, errdefs.New(errdefs.ErrUnauthenticated, "invalid username: %q is not a user in the sandbox's /etc/passwd", name)
}

// userName returns the name for uid, or the number as text.
func (u users) userName(uid uint32) string {
	for _, p := range u.passwd() {
		if p.uid == uid {
			return p.name
		}
	}
	if uid == 0 {
		return "root"
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// groupName returns the name for gid, or the number as text.
func (u users) groupName(gid uint32) string {
	for _, g := range u.groups() {
		if g.gid == gid {
			return g.name
		}
	}
	if gid == 0 {
		return "root"
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// basicUser extracts the user name from an "Authorization: Basic
// base64(name:)" header as E2B's SDKs send it. Empty header → "".
func basicUser(header string) (string, error) {
	if header == "" {
		return "", nil
	}
	const prefix = "Basic "
	if len(header) < len(prefix) || !strings.EqualFold(header[:len(prefix)], prefix) {
		return "", errdefs.New(errdefs.ErrUnauthenticated, "invalid username: Authorization header is not Basic; send Basic base64(\"<user>:\")")
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(header[len(prefix):]))
	if err != nil {
		return "", errdefs.New(errdefs.ErrUnauthenticated, "invalid username: Authorization Basic value is not base64")
	}
	name, _, _ := strings.Cut(string(raw), ":")
	return name, nil
}

// resolvePath makes p absolute the way envd does: "~" and "~/x" expand to
// home, relative paths are under home. Invalid UTF-8 or NUL is rejected.
func resolvePath(field, p, home string) (string, error) {
	if err := checkPath(field, p); err != nil {
		return "", err
	}
	switch {
	case p == "~":
		p = home
	case strings.HasPrefix(p, "~/"):
		p = filepath.Join(home, p[2:])
	case !filepath.IsAbs(p):
		p = filepath.Join(home, p)
	}
	return filepath.Clean(p), nil
}

func checkPath(field, p string) error {
	if !utf8.ValidString(p) {
		return errdefs.Invalid(field, "is not valid UTF-8; send the path as UTF-8 text")
	}
	if strings.IndexByte(p, 0) >= 0 {
		return errdefs.Invalid(field, "contains a NUL byte; remove it")
	}
	return nil
}
