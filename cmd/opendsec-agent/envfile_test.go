package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadEnvFile: lines set the environment over what was there, a
// missing file sets nothing, a line without '=' is an error naming it.
func TestLoadEnvFile(t *testing.T) {
	t.Setenv("OD_ENVFILE_A", "old")
	p := filepath.Join(t.TempDir(), "env")
	if err := loadEnvFile(p); err != nil {
		t.Fatalf("missing file: %v", err)
	}
	if err := os.WriteFile(p, []byte("OD_ENVFILE_A=new\nOD_ENVFILE_B=x=y\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("OD_ENVFILE_B", "")
	if err := loadEnvFile(p); err != nil {
		t.Fatal(err)
	}
	if a, b := os.Getenv("OD_ENVFILE_A"), os.Getenv("OD_ENVFILE_B"); a != "new" || b != "x=y" {
		t.Fatalf("env after the file: A=%q B=%q", a, b)
	}
	if err := os.WriteFile(p, []byte("NOEQUALS\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := loadEnvFile(p); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("bad line: %v; want an error naming line 1", err)
	}
}
