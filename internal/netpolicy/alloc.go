package netpolicy

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// allocator hands out /31s of the pool. Each allocation is a file
// <dir>/<index> holding the sandbox ID, created with O_EXCL, so an address
// survives a node restart and two allocators never hand out the same one.
// Index 0 is reserved for the DNS proxy.
type allocator struct {
	dir  string
	pool netip.Prefix
	max  int // highest usable index

	mu   sync.Mutex
	next int // guarded by mu; where the next search starts
}

func newAllocator(dir string, pool netip.Prefix) (*allocator, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create allocation dir: %w", err)
	}
	size := 1 << (32 - pool.Bits())
	return &allocator{dir: dir, pool: pool, max: size/2 - 1, next: 1}, nil
}

// pair returns the node-side (gateway) and sandbox-side addresses of index.
func (a *allocator) pair(index int) (gw, sb netip.Addr) {
	b := a.pool.Addr().As4()
	base := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	g := base + uint32(2*index)
	return u32Addr(g), u32Addr(g + 1)
}

// dnsAddr is the DNS proxy's address: the second address of index 0.
func (a *allocator) dnsAddr() netip.Addr {
	_, sb := a.pair(0)
	return sb
}

// indexOf returns the index of a sandbox-side address, or -1.
func (a *allocator) indexOf(addr netip.Addr) int {
	if !a.pool.Contains(addr) {
		return -1
	}
	b, p := addr.As4(), a.pool.Addr().As4()
	d := (uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])) -
		(uint32(p[0])<<24 | uint32(p[1])<<16 | uint32(p[2])<<8 | uint32(p[3]))
	if d%2 == 0 {
		return -1
	}
	return int(d / 2)
}

func u32Addr(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// alloc reserves a free index for id.
func (a *allocator) alloc(id string) (int, error) { return a.allocWith(id, nil) }

// path is the allocation file of index.
func (a *allocator) path(index int) string { return filepath.Join(a.dir, strconv.Itoa(index)) }

// allocWith is alloc with the allocation file holding record(index)
// instead of the bare ID: a JSON object whose "id" is id (the sandbox's
// network state, which Setup then links as its state file: one file
// made per sandbox instead of two).
func (a *allocator) allocWith(id string, record func(index int) ([]byte, error)) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for n := 0; n < a.max; n++ {
		idx := (a.next-1+n)%a.max + 1
		content := []byte(id)
		if record != nil {
			var err error
			if content, err = record(idx); err != nil {
				return 0, err
			}
		}
		f, err := os.OpenFile(a.path(idx), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("record address allocation: %w", err)
		}
		_, werr := f.Write(content)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			os.Remove(f.Name())
			return 0, fmt.Errorf("record address allocation: %w", werr)
		}
		a.next = idx%a.max + 1
		return idx, nil
	}
	return 0, errdefs.New(errdefs.ErrResourceExhausted, "network pool %s has no free address; raise network.pool or stop sandboxes", a.pool)
}

// release frees index if it is held by id.
func (a *allocator) release(index int, id string) error {
	p := filepath.Join(a.dir, strconv.Itoa(index))
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read address allocation: %w", err)
	}
	if ownerOf(b) != id {
		return nil
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("release address: %w", err)
	}
	return nil
}

// list returns every allocation as index → sandbox ID.
func (a *allocator) list() (map[int]string, error) {
	ents, err := os.ReadDir(a.dir)
	if err != nil {
		return nil, fmt.Errorf("list address allocations: %w", err)
	}
	out := map[int]string{}
	for _, e := range ents {
		idx, err := strconv.Atoi(e.Name())
		if err != nil || idx < 1 {
			continue
		}
		b, err := os.ReadFile(filepath.Join(a.dir, e.Name()))
		if err != nil {
			continue
		}
		out[idx] = ownerOf(b)
	}
	return out, nil
}

// ownerOf returns the sandbox ID in an allocation file: the file itself,
// or the "id" of the JSON object allocWith wrote ("" if it is torn).
func ownerOf(b []byte) string {
	if len(b) == 0 || b[0] != '{' {
		return strings.TrimSpace(string(b))
	}
	var rec struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(b, &rec) != nil {
		return ""
	}
	return rec.ID
}
