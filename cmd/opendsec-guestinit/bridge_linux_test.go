package main

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestFindPortByName(t *testing.T) {
	sys, dev := t.TempDir(), t.TempDir()
	for port, name := range map[string]string{"vport0p1": "other", "vport1p1": "agent"} {
		if err := os.MkdirAll(filepath.Join(sys, port), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sys, port, "name"), []byte(name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dev, port), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := findPort(ctx, sys, dev, "agent")
	if err != nil || got != filepath.Join(dev, "vport1p1") {
		t.Fatalf("findPort = %q, %v; want %s", got, err, filepath.Join(dev, "vport1p1"))
	}
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := findPort(short, sys, dev, "missing"); err == nil {
		t.Fatal("findPort of a missing port: no error")
	}
}
