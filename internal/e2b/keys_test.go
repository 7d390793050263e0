package e2b

import (
	"errors"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestKeyStoreCreateLookup(t *testing.T) {
	path := filepath.Join(t.TempDir(), "e2b", "keys.json")
	s := NewKeyStore(path)
	k, err := s.Create("team-a")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^e2b_[0-9a-f]{40}$`).MatchString(k) {
		t.Fatalf("key %q is not e2b_<40 hex>", k)
	}
	// A second store (another process) sees the key written by the first.
	p, err := NewKeyStore(path).Lookup(k)
	if err != nil || p != "team-a" {
		t.Fatalf("Lookup = %q, %v; want team-a", p, err)
	}
	k2, err := s.Create("team-b")
	if err != nil {
		t.Fatal(err)
	}
	if p, err := s.Lookup(k2); err != nil || p != "team-b" {
		t.Fatalf("Lookup(k2) = %q, %v", p, err)
	}
	if p, err := s.Lookup(k); err != nil || p != "team-a" {
		t.Fatalf("first key lost after second create: %q, %v", p, err)
	}
	for _, bad := range []string{"", "e2b_" + "0000000000000000000000000000000000000000", "sk_e2b_123", k + "0"} {
		if _, err := s.Lookup(bad); !errors.Is(err, errdefs.ErrUnauthenticated) {
			t.Errorf("Lookup(%q) = %v; want unauthenticated", bad, err)
		}
	}
	if _, err := s.Create("Bad Principal"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Create(bad principal) = %v; want invalid argument", err)
	}
}

func TestMetadataLabelsRoundTrip(t *testing.T) {
	md := map[string]string{"sandbox_test_id": "x1", "a.b/c-D": "v", "ünï": "u"}
	labels := map[string]string{}
	if err := metadataLabels(md, labels); err != nil {
		t.Fatal(err)
	}
	if labels["e2b.meta/sandbox.5ftest.5fid"] != "x1" {
		t.Fatalf("labels = %v", labels)
	}
	labelKey := regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$`)
	for l := range labels {
		if !labelKey.MatchString(l) {
			t.Errorf("label key %q is not a valid OpenDsec label key", l)
		}
	}
	labels[labelTeam] = "t"
	got := metadataOf(labels)
	if len(got) != len(md) {
		t.Fatalf("metadataOf = %v; want %v", got, md)
	}
	for k, v := range md {
		if got[k] != v {
			t.Errorf("metadata[%q] = %q; want %q", k, got[k], v)
		}
	}
	long := map[string]string{}
	for i := range MaxMetadata + 1 {
		long[string(rune('a'+i%26))+string(rune('a'+i/26))] = "v"
	}
	if err := metadataLabels(long, map[string]string{}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("too many entries: %v; want invalid argument", err)
	}
	if err := metadataLabels(map[string]string{"k": string(make([]byte, 257))}, map[string]string{}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("long value: %v; want invalid argument", err)
	}
}

func TestSignatureMatchesEnvd(t *testing.T) {
	// Reference computed as the E2B SDKs do: v1_ + base64 (no padding) of
	// sha256("path:read:user:token:123").
	got := Signature("/a.txt", "read", "user", "tok", "123")
	if want := "v1_I1EyiZdSDnhdyzSdZfdVzl5o/YIBrHKtZ49UlHDK2HE"; got != want {
		t.Fatalf("Signature = %q; want %q", got, want)
	}
	if Signature("/a.txt", "read", "user", "tok", "") == got {
		t.Fatal("expiration is not part of the signature")
	}
}
