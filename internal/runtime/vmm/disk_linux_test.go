package vmm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// TestMakeDisk: a sparse file of the size asked with an ext4 labelled
// opendsec-rw; an existing file is refused and left as it was.
func TestMakeDisk(t *testing.T) {
	p := filepath.Join(t.TempDir(), "rw.ext4")
	if err := MakeDisk(context.Background(), p, 64); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Size() != 64<<20 {
		t.Fatalf("disk: %v, %v; want 64 MiB", fi, err)
	}
	if used := fi.Sys().(*syscall.Stat_t).Blocks * 512; used >= 64<<20 {
		t.Errorf("the disk allocates %d bytes: not sparse", used)
	}
	b := make([]byte, 2048)
	f, _ := os.Open(p)
	_, _ = f.ReadAt(b, 0)
	_ = f.Close()
	// The superblock is at 1024: magic 0xEF53 at 0x38, label at 0x78.
	if b[1024+0x38] != 0x53 || b[1024+0x39] != 0xef || !bytes.HasPrefix(b[1024+0x78:], []byte("opendsec-rw\x00")) {
		t.Fatal("the disk has no ext4 labelled opendsec-rw")
	}
	if err := MakeDisk(context.Background(), p, 8); !errors.Is(err, fs.ErrExist) || !errors.Is(err, errdefs.ErrInternal) {
		t.Fatalf("MakeDisk over an existing file: %v; want internal, exists", err)
	}
	if fi, _ := os.Stat(p); fi.Size() != 64<<20 {
		t.Fatal("MakeDisk changed an existing file")
	}
}

// TestWriteConfigDisk: the guest's configuration as JSON in whole 4 KiB
// blocks, NUL-padded; one over 1 MiB is refused naming the field and
// writes nothing.
func TestWriteConfigDisk(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "config.img")
	g := runtime.Guest{Env: []string{"A=1"}, User: "u", Workdir: "/w", Nameservers: []string{"10.0.0.1"}}
	if err := WriteConfigDisk(p, g); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	if len(b) != 4096 {
		t.Fatalf("config disk is %d bytes; want 4096", len(b))
	}
	var got vmchan.GuestConfig
	if err := json.Unmarshal(bytes.TrimRight(b, "\x00"), &got); err != nil || got.User != "u" || got.Workdir != "/w" || got.Env[0] != "A=1" || got.Nameservers[0] != "10.0.0.1" {
		t.Fatalf("config disk holds %+v (%v)", got, err)
	}
	big := filepath.Join(dir, "big.img")
	err := WriteConfigDisk(big, runtime.Guest{Env: []string{"A=" + strings.Repeat("x", 1<<20)}})
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != "guest" {
		t.Fatalf("a 1 MiB configuration: %v; want invalid guest", err)
	}
	if _, err := os.Stat(big); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a refused configuration left a file: %v", err)
	}
}
