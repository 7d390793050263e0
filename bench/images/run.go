package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// bench holds what a run made, so cleanup can remove it.
type bench struct {
	cfg    config
	client *opendsec.Client
	dir    string // our temp dir under cfg.work
	disk   disk
	label  map[string]string // on every sandbox we create
	base   *baseline
	log    io.Writer

	mu     sync.Mutex
	ours   map[string]bool // sandboxes created and not yet stopped
	images []string        // images imported and not yet removed
}

// result is one measured run of n sandboxes (ours) or containers
// (baseline) of one image.
type result struct {
	n          int
	allRunning time.Duration   // start until the last one runs
	each       []time.Duration // baseline: each container's extract + run
	written    int64           // bytes the data disk wrote (after sync)
	du         int64           // disk usage added while they ran
}

// importResult is one fresh import and the first sandbox after it.
type importResult struct {
	importDur, first time.Duration
	written          int64 // by the import
	storeDu          int64 // the store's du after it
}

func run(ctx context.Context, c config) (retErr error) {
	if err := validate(c); err != nil {
		return err
	}
	token := os.Getenv(opendsec.EnvToken)
	if c.tokenFile != "" {
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return fmt.Errorf("read token (flag -token-file): %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	client, err := opendsec.New(c.endpoint, opendsec.WithToken(token))
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	defer client.Close()
	if _, err := client.ListSandboxes(ctx, opendsec.ListFilter{}); err != nil {
		return fmt.Errorf("reach apiserver at %s: %w", client.Endpoint(), err)
	}
	b := &bench{
		cfg: c, client: client, log: os.Stderr, ours: map[string]bool{},
		label: map[string]string{"opendsec-bench": fmt.Sprintf("images-%d", os.Getpid())},
	}
	if err := os.MkdirAll(c.work, 0o755); err != nil {
		return fmt.Errorf("flag -work: %w", err)
	}
	if b.dir, err = os.MkdirTemp(c.work, "odbench-images."); err != nil {
		return fmt.Errorf("flag -work: %w", err)
	}
	defer func() {
		if err := b.cleanup(context.WithoutCancel(ctx)); err != nil {
			retErr = errors.Join(retErr, fmt.Errorf("cleanup: %w", err))
		}
	}()
	if b.disk, err = diskOf(b.dir); err != nil {
		return err
	}
	if dd, err := diskOf(c.dataDir); err != nil || dd.stat != b.disk.stat {
		return fmt.Errorf("the system's data dir %s and -work %s must be on one disk, so one write counter sees both sides (%v)", c.dataDir, c.work, err)
	}
	if b.base, err = newBaseline(ctx, c, b.dir); err != nil {
		return err
	}

	r := &report{cfg: c, started: time.Now(), loadStart: loadAvg(), disk: b.disk.name, cgMode: b.base.cgMode}
	if r.freeStart, err = freeBytes(b.dir); err != nil {
		return err
	}
	b.logf("== images (work dir %s, disk %s)", b.dir, b.disk.name)
	var imgs []*benchImage
	if c.smallMiB > 0 {
		im, err := b.makeImage(ctx, c.smallMiB, 1)
		if err != nil {
			return err
		}
		imgs = append(imgs, im)
	}
	big, err := b.makeImage(ctx, c.bigMiB, 2)
	if err != nil {
		return err
	}
	imgs = append(imgs, big)
	r.images = imgs

	type run struct {
		name string
		im   *benchImage
		n    int
		fn   func(context.Context, *benchImage, int) (result, error)
	}
	var runs []run
	if c.smallMiB > 0 {
		runs = append(runs,
			run{"ours", imgs[0], c.smallCount, b.oursRun},
			run{"baseline", imgs[0], c.smallCount, b.base.run})
	}
	if c.baselineBig > 0 {
		if c.oursAtBaseline {
			runs = append(runs, run{"ours", big, c.baselineBig, b.oursRun})
		}
		runs = append(runs, run{"baseline", big, c.baselineBig, b.base.run})
	}
	runs = append(runs, run{"ours", big, c.count, b.oursRun})
	r.results = map[string][]result{}
	r.imports = map[string][]importResult{}
	for round := 1; round <= c.rounds; round++ {
		for _, im := range imgs {
			b.logf("== round %d: fresh import of %s and its first sandbox", round, im.label)
			ir, err := b.freshImport(ctx, im)
			if err != nil {
				return fmt.Errorf("import %s: %w", im.label, err)
			}
			b.logf("   import %s, first sandbox %s, %s written", ir.importDur.Round(time.Millisecond), ir.first.Round(time.Millisecond), human(ir.written))
			r.imports[im.label] = append(r.imports[im.label], ir)
		}
		if err := b.ensureImported(ctx, imgs); err != nil {
			return err
		}
		for _, x := range runs {
			b.logf("== round %d: %s, %d x %s", round, x.name, x.n, x.im.label)
			res, err := x.fn(ctx, x.im, x.n)
			if err != nil {
				return fmt.Errorf("%s %d x %s: %w", x.name, x.n, x.im.label, err)
			}
			b.logf("   all running after %s; %s written, %s du", res.allRunning.Round(time.Millisecond), human(res.written), human(res.du))
			k := key(x.name, x.im, x.n)
			r.results[k] = append(r.results[k], res)
		}
	}
	r.elapsed = time.Since(r.started)
	r.loadEnd = loadAvg()
	md := r.markdown()
	fmt.Print(md)
	if err := os.MkdirAll(filepath.Dir(c.out), 0o755); err != nil {
		return fmt.Errorf("make results dir: %w", err)
	}
	if err := os.WriteFile(c.out, []byte(md), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	b.logf("report written to %s", c.out)
	return nil
}

func key(side string, im *benchImage, n int) string {
	return fmt.Sprintf("%s|%s|%d", side, im.label, n)
}

func (b *bench) logf(format string, args ...any) { fmt.Fprintf(b.log, format+"\n", args...) }

func (b *bench) spec(image string) *opendsec.SandboxSpec {
	return &opendsec.SandboxSpec{
		Image: image, Backend: "container", Labels: b.label, TimeoutSeconds: 3600,
		MemoryMb: proto.Int64(b.cfg.memoryMB), Cpu: b.cfg.cpu, PidsLimit: b.cfg.pids,
	}
}

// freshImport removes the image and collects its layers (so nothing is
// left from an earlier round), imports it from its OCI layout through the
// API and creates one sandbox of it: the time from "here is an image" to a
// sandbox running it.
func (b *bench) freshImport(ctx context.Context, im *benchImage) (importResult, error) {
	b.mu.Lock()
	names := slices.Clone(b.images)
	b.images = nil
	b.mu.Unlock()
	for _, name := range names { // they share the busybox layer
		if err := b.client.RemoveImage(ctx, name); err != nil && !opendsec.IsNotFound(err) {
			return importResult{}, fmt.Errorf("remove image: %w", err)
		}
	}
	if _, err := b.client.GarbageCollectImages(ctx); err != nil {
		return importResult{}, fmt.Errorf("gc images: %w", err)
	}
	store := filepath.Join(b.cfg.dataDir, "images")
	if n := du(filepath.Join(store, "layers")); n > 1<<20 {
		return importResult{}, fmt.Errorf("the store still holds %s of layers after gc; a fresh import needs an empty store", human(n))
	}
	w0, err := b.disk.written()
	if err != nil {
		return importResult{}, err
	}
	start := time.Now()
	if err := b.importImage(ctx, im); err != nil {
		return importResult{}, err
	}
	ir := importResult{importDur: time.Since(start)}
	if ir.written, err = b.disk.written(); err != nil {
		return importResult{}, err
	}
	ir.written -= w0
	ir.storeDu = du(store)
	start = time.Now()
	sb, err := b.client.CreateSandbox(ctx, b.spec(im.name))
	if err != nil {
		return importResult{}, fmt.Errorf("first sandbox: %w", err)
	}
	ir.first = time.Since(start)
	b.track(sb.GetId(), true)
	if st := sb.GetState(); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		return importResult{}, fmt.Errorf("first sandbox %s is %s, want running", sb.GetId(), st)
	}
	return ir, b.stop(ctx, sb.GetId())
}

func (b *bench) importImage(ctx context.Context, im *benchImage) error {
	b.mu.Lock()
	b.images = append(b.images, im.name)
	b.mu.Unlock()
	_, err := b.client.ImportImage(ctx, "oci-layout:"+im.layout+":v1", &opendsec.ImportOptions{Name: im.name})
	return err
}

// ensureImported imports the images that are not in the store.
func (b *bench) ensureImported(ctx context.Context, imgs []*benchImage) error {
	for _, im := range imgs {
		b.mu.Lock()
		have := slices.Contains(b.images, im.name)
		b.mu.Unlock()
		if !have {
			if err := b.importImage(ctx, im); err != nil {
				return fmt.Errorf("import %s: %w", im.label, err)
			}
		}
	}
	return nil
}

// oursRun creates n sandboxes of im in one BatchCreate (the apiserver runs
// 8 at once) and times until the last is running.
func (b *bench) oursRun(ctx context.Context, im *benchImage, n int) (result, error) {
	res := result{n: n}
	du0 := du(b.cfg.dataDir)
	w0, err := b.disk.written()
	if err != nil {
		return res, err
	}
	var ids []string
	var errs []error
	start := time.Now()
	err = b.client.BatchCreate(ctx, b.spec(im.name), n, func(r opendsec.BatchResult) {
		if r.Err != nil {
			errs = append(errs, fmt.Errorf("sandbox %d: %w", r.Index, r.Err))
			return
		}
		ids = append(ids, r.Sandbox.GetId())
		b.track(r.Sandbox.GetId(), true)
	})
	res.allRunning = time.Since(start)
	defer b.stopAll(context.WithoutCancel(ctx), ids)
	if err = errors.Join(append([]error{err}, errs...)...); err != nil {
		return res, err
	}
	for _, id := range ids {
		sb, err := b.client.GetSandbox(ctx, id)
		if err != nil {
			return res, err
		}
		if sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			return res, fmt.Errorf("sandbox %s is %s, want running", id, sb.GetState())
		}
	}
	w1, err := b.disk.written()
	if err != nil {
		return res, err
	}
	res.written = w1 - w0
	res.du = du(b.cfg.dataDir) - du0
	return res, nil
}

func (b *bench) track(id string, live bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if live {
		b.ours[id] = true
	} else {
		delete(b.ours, id)
	}
}

func (b *bench) stop(ctx context.Context, id string) error {
	if err := b.client.StopSandbox(ctx, id); err != nil && !opendsec.IsNotFound(err) {
		return fmt.Errorf("stop sandbox %s: %w", id, err)
	}
	b.track(id, false)
	return nil
}

// stopAll stops sandboxes 8 at a time.
func (b *bench) stopAll(ctx context.Context, ids []string) error {
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for _, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := b.stop(ctx, id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// cleanup stops every sandbox we made (also any carrying our label, in
// case a create answer was lost), removes our images and collects their
// layers, removes the baseline's containers and our temp dir.
func (b *bench) cleanup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	var errs []error
	b.mu.Lock()
	ids := make([]string, 0, len(b.ours))
	for id := range b.ours {
		ids = append(ids, id)
	}
	images := b.images
	b.mu.Unlock()
	if list, err := b.client.ListSandboxes(ctx, opendsec.ListFilter{Labels: b.label}); err == nil {
		for _, sb := range list {
			ids = append(ids, sb.GetId())
		}
	}
	errs = append(errs, b.stopAll(ctx, ids))
	for _, name := range images {
		if err := b.client.RemoveImage(ctx, name); err != nil && !opendsec.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if len(images) > 0 {
		if _, err := b.client.GarbageCollectImages(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	var berr error
	if b.base != nil {
		berr = b.base.close(ctx)
		errs = append(errs, berr)
	}
	if berr == nil { // else a container may still run on a root in it
		errs = append(errs, os.RemoveAll(b.dir))
	} else {
		errs = append(errs, fmt.Errorf("left %s in place", b.dir))
	}
	return errors.Join(errs...)
}

func human(n int64) string {
	switch {
	case n >= 1<<30 || n <= -1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20 || n <= -1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	default:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
}
