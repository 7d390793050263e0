package e2b

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// E2B's special step names (the SDK maps a failed step to its call site).
const (
	stepBase     = "base"
	stepFinalize = "finalize"
)

var (
	tplNameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._/-]{0,127}$`)
	// tplIDRe is the form of a template ID (newTemplateID): no name.
	tplIDRe  = regexp.MustCompile(`^tpl-[0-9a-f]{16}$`)
	tagRe    = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$`)
	envKeyRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	userRe   = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?$`)
	modeRe   = regexp.MustCompile(`^[0-7]{3,4}$`)
	dfLineRe = regexp.MustCompile(`^(dockerfile: )?line \d+: `)
)

// templateBuildRequest is E2B's TemplateBuildRequestV3.
type templateBuildRequest struct {
	Name     string   `json:"name"`
	Alias    string   `json:"alias"`
	Tags     []string `json:"tags"`
	CPUCount int      `json:"cpuCount"`
	MemoryMB int      `json:"memoryMB"`
}

// templateStep is E2B's TemplateStep.
type templateStep struct {
	Type        string   `json:"type"`
	Args        []string `json:"args"`
	FilesHash   string   `json:"filesHash"`
	Force       bool     `json:"force"`
	ForceUpload *bool    `json:"forceUpload"`
}

// templateBuildStart is E2B's TemplateBuildStartV2.
type templateBuildStart struct {
	FromImage         *string         `json:"fromImage"`
	FromTemplate      *string         `json:"fromTemplate"`
	FromImageRegistry json.RawMessage `json:"fromImageRegistry"`
	Force             bool            `json:"force"`
	Steps             []templateStep  `json:"steps"`
	StartCmd          string          `json:"startCmd"`
	ReadyCmd          string          `json:"readyCmd"`
}

// requestTemplateBuild is POST /v3/templates → 202: a new build (waiting
// for its start) of the caller's template name, made if new.
func (g *Gateway) requestTemplateBuild(w http.ResponseWriter, r *http.Request) {
	var req templateBuildRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	ref := cmp.Or(req.Name, req.Alias)
	if ref == "" {
		writeError(w, http.StatusBadRequest, "name: is empty; name the template, e.g. my-template or my-template:v1")
		return
	}
	name, tag := ref, ""
	if i := strings.LastIndex(ref, ":"); i > 0 {
		name, tag = ref[:i], ref[i+1:]
	}
	if !tplNameRe.MatchString(name) {
		writeError(w, http.StatusBadRequest, "name: %q is not a template name (lowercase letters, digits, '.', '_', '-', '/'; at most 128)", name)
		return
	}
	if tplIDRe.MatchString(name) {
		writeError(w, http.StatusBadRequest, "name: %q has the form of a template ID; choose another name", name)
		return
	}
	if slices.Contains(g.templateNames(), name) || strings.HasPrefix(name, tplImagePrefix) {
		writeError(w, http.StatusConflict, "name: %q is a template of this gateway; choose another name", name)
		return
	}
	tags := slices.Clone(req.Tags)
	if tag != "" {
		tags = append([]string{tag}, tags...)
	}
	if len(tags) == 0 {
		tags = []string{defaultTag}
	}
	for _, t := range tags {
		if !tagRe.MatchString(t) {
			writeError(w, http.StatusBadRequest, "tags: %q is not a tag (letters, digits, '.', '_', '-'; at most 128)", t)
			return
		}
	}
	slices.Sort(tags)
	tags = slices.Compact(tags)
	if req.CPUCount < 0 || req.MemoryMB < 0 {
		writeError(w, http.StatusBadRequest, "cpuCount and memoryMB must not be negative")
		return
	}
	p := principal(r.Context())
	now := time.Now().UTC()
	s := g.tpls
	s.mu.Lock()
	t, ok := s.getLocked(p, name)
	if !ok {
		n := 0
		for _, o := range s.all {
			if o.Owner == p {
				n++
			}
		}
		if n >= maxTemplatesPerPrincipal {
			s.mu.Unlock()
			writeError(w, http.StatusTooManyRequests, "you have %d templates, the most allowed; delete some (DELETE /templates/{id})", n)
			return
		}
		t = &tplRecord{ID: newTemplateID(), Owner: p, Name: name, Created: now, Builds: map[string]*tplBuild{}, Tags: map[string]tagRecord{}}
		s.all[t.ID] = t
	}
	b := &tplBuild{ID: newBuildID(), Status: buildWaiting, Created: now, Updated: now, Tags: tags, CPU: req.CPUCount, MemMB: req.MemoryMB}
	stale := t.pruneLocked()
	t.Builds[b.ID] = b
	t.Updated = now
	err := s.saveLocked()
	id := t.ID
	s.mu.Unlock()
	g.removeImages(stale)
	if err != nil {
		writeErr(w, fmt.Errorf("save templates: %w", err))
		return
	}
	writeJSON(w, http.StatusAccepted, map[string]any{
		"templateID": id, "buildID": b.ID, "names": []string{name}, "tags": tags, "public": false, "aliases": []string{name},
	})
}

// plannedBuild is a template build turned into a Dockerfile.
type plannedBuild struct {
	dockerfile string
	// stepOf is the E2B step of each Dockerfile instruction (index 0 is
	// FROM, the native builder's step 1).
	stepOf []string
	// archives are the COPY uploads by hash (their files on this host).
	archives      map[string]string
	base          string
	user, workdir string
}

// dfQuote quotes s as one word of a Dockerfile instruction that the
// builder expands (ENV, WORKDIR): double quotes, with \, " and $ escaped.
func dfQuote(s string) string {
	return `"` + dfQuoter.Replace(s) + `"`
}

var dfQuoter = strings.NewReplacer(`\`, `\\`, `"`, `\"`, `$`, `\$`)

func jsonArgs(args ...string) string {
	b, _ := json.Marshal(args)
	return string(b)
}

// planBuild checks a build start and turns it into a Dockerfile over
// base (the image FROM names) whose user and workdir are user and workdir
// (empty: E2B's defaults "user" and /home/user are set first).
func (g *Gateway) planBuild(p string, req templateBuildStart, base, user, workdir string) (*plannedBuild, error) {
	pb := &plannedBuild{archives: map[string]string{}, base: base}
	var df strings.Builder
	add := func(step, line string) {
		df.WriteString(line + "\n")
		pb.stepOf = append(pb.stepOf, step)
	}
	add(stepBase, "FROM "+base)
	if user == "" {
		user, workdir = "user", "/home/user"
		add(stepBase, "USER user")
		add(stepBase, "WORKDIR /home/user")
	}
	bad := func(i int, format string, args ...any) error {
		return errdefs.New(errdefs.ErrInvalidArgument, "steps[%d]: %s", i, fmt.Sprintf(format, args...))
	}
	for i, st := range req.Steps {
		step := strconv.Itoa(i + 1)
		switch st.Type {
		case "RUN":
			if len(st.Args) < 1 || len(st.Args) > 2 || strings.TrimSpace(st.Args[0]) == "" {
				return nil, bad(i, "RUN takes args [command] or [command, user]")
			}
			runAs := user
			if len(st.Args) == 2 && st.Args[1] != "" {
				if !userRe.MatchString(st.Args[1]) {
					return nil, bad(i, "RUN user %q is not a user name or uid[:gid]", st.Args[1])
				}
				runAs = st.Args[1]
			}
			if runAs != user {
				add(step, "USER "+runAs)
			}
			add(step, "RUN "+jsonArgs("/bin/sh", "-c", st.Args[0]))
			if runAs != user {
				add(step, "USER "+user)
			}
		case "COPY":
			if len(st.Args) < 2 || len(st.Args) > 4 {
				return nil, bad(i, "COPY takes args [src, dest, user?, mode?]")
			}
			src, dest := st.Args[0], st.Args[1]
			cs := path.Clean(src)
			if src == "" || dest == "" || path.IsAbs(src) || cs == ".." || strings.HasPrefix(cs, "../") ||
				!noNewline(src) || !noNewline(dest) || strings.Contains(src+dest, "$") {
				return nil, bad(i, "COPY %q %q: the source must be a relative path in the context and neither may contain a newline or $", src, dest)
			}
			if !filesHashRe.MatchString(st.FilesHash) {
				return nil, bad(i, "COPY needs filesHash, the SDK's sha256 of its files (64 hex digits)")
			}
			file := g.filePath(p, st.FilesHash)
			if _, err := os.Stat(file); err != nil {
				return nil, bad(i, "COPY %s: its files (hash %s) were not uploaded; upload them to the URL GET /templates/{templateID}/files/{hash} gives", src, st.FilesHash)
			}
			if !checkFilesHash(func() (io.ReadCloser, error) { return os.Open(file) }, src, dest, st.FilesHash) {
				// Not what the SDK said it sent: drop it, so a correct
				// upload can replace it.
				_ = os.Remove(file)
				return nil, bad(i, "COPY %s %s: filesHash %s does not match the uploaded files; the upload was discarded, upload them again", src, dest, st.FilesHash)
			}
			pb.archives[st.FilesHash] = file
			now := time.Now()
			_ = os.Chtimes(file, now, now) // used: kept (sweepFiles)
			flags := ""
			owner := user
			if len(st.Args) > 2 && st.Args[2] != "" {
				owner = st.Args[2]
			}
			if !userRe.MatchString(owner) {
				return nil, bad(i, "COPY user %q is not a user[:group]", owner)
			}
			if owner != "root" && owner != "0" {
				flags += " --chown=" + owner
			}
			if len(st.Args) > 3 && st.Args[3] != "" {
				if !modeRe.MatchString(st.Args[3]) {
					return nil, bad(i, "COPY mode %q is not an octal mode like 0755", st.Args[3])
				}
				flags += " --chmod=" + st.Args[3]
			}
			add(step, "COPY"+flags+" "+jsonArgs("files/"+st.FilesHash+"/"+cs, dest))
		case "ENV":
			if len(st.Args) < 2 || len(st.Args)%2 != 0 {
				return nil, bad(i, "ENV takes args [key, value, key, value, ...]")
			}
			var kv []string
			for j := 0; j < len(st.Args); j += 2 {
				if !envKeyRe.MatchString(st.Args[j]) {
					return nil, bad(i, "ENV key %q is not a variable name", st.Args[j])
				}
				if !noNewline(st.Args[j+1]) {
					return nil, bad(i, "ENV %s: the value contains a newline", st.Args[j])
				}
				kv = append(kv, st.Args[j]+"="+dfQuote(st.Args[j+1]))
			}
			add(step, "ENV "+strings.Join(kv, " "))
		case "WORKDIR":
			if len(st.Args) != 1 || st.Args[0] == "" || !noNewline(st.Args[0]) {
				return nil, bad(i, "WORKDIR takes args [path] (no newline)")
			}
			wd := st.Args[0]
			if !path.IsAbs(wd) {
				wd = path.Join(workdir, wd)
			}
			workdir = path.Clean(wd)
			add(step, "WORKDIR "+dfQuote(workdir))
		case "USER":
			if len(st.Args) != 1 || !userRe.MatchString(st.Args[0]) {
				return nil, bad(i, "USER takes args [user] (a user name or uid[:gid])")
			}
			user = st.Args[0]
			add(step, "USER "+user)
		default:
			return nil, bad(i, "type %q is not a step type; use RUN, COPY, ENV, WORKDIR or USER", st.Type)
		}
	}
	pb.dockerfile, pb.user, pb.workdir = df.String(), user, workdir
	return pb, nil
}

// startTemplateBuild is POST /v2/templates/{templateID}/builds/{buildID}
// → 202: checks the steps and uploads, then builds in the background.
func (g *Gateway) startTemplateBuild(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	tid, bid := r.PathValue("id"), r.PathValue("buildID")
	var req templateBuildStart
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	t, ok := g.tpls.get(p, tid)
	if !ok {
		writeError(w, http.StatusNotFound, "template %q not found", tid)
		return
	}
	g.tpls.mu.Lock()
	b, ok := t.Builds[bid]
	status := ""
	if ok {
		status = b.Status
	}
	g.tpls.mu.Unlock()
	if !ok {
		writeError(w, http.StatusNotFound, "build %q of template %q not found", bid, tid)
		return
	}
	if status != buildWaiting {
		writeError(w, http.StatusConflict, "build %q was started already (%s); request a new build with POST /v3/templates", bid, status)
		return
	}
	if len(req.FromImageRegistry) > 0 && string(req.FromImageRegistry) != "null" {
		writeError(w, http.StatusBadRequest, "fromImageRegistry: registry credentials are not supported; OpenDsec builds from images in its store (ask the operator to import the image)")
		return
	}
	if (req.FromImage == nil) == (req.FromTemplate == nil) || (req.FromImage != nil && *req.FromImage == "") || (req.FromTemplate != nil && *req.FromTemplate == "") {
		writeError(w, http.StatusBadRequest, "give exactly one of fromImage and fromTemplate")
		return
	}
	if len(req.Steps) > 1000 {
		writeError(w, http.StatusBadRequest, "steps: %d steps; at most 1000", len(req.Steps))
		return
	}
	if !noNewline(req.StartCmd) || !noNewline(req.ReadyCmd) || len(req.StartCmd) > 64<<10 || len(req.ReadyCmd) > 64<<10 {
		writeError(w, http.StatusBadRequest, "startCmd and readyCmd must be one line of at most 64 KiB")
		return
	}
	var base, user, workdir string
	if req.FromTemplate != nil {
		ref := *req.FromTemplate
		if _, pbuild, ok := g.tpls.resolveStart(p, ref); ok {
			base, user, workdir = pbuild.Image, pbuild.User, pbuild.Workdir
		} else if strings.HasPrefix(ref, tplImagePrefix) || g.isSnapshotTemplate(ref) {
			writeError(w, http.StatusBadRequest, "fromTemplate: template %q not found", ref)
			return
		} else {
			base = g.imageFor(ref)
		}
	} else {
		base = *req.FromImage
		if strings.HasPrefix(base, tplImagePrefix) {
			writeError(w, http.StatusBadRequest, "fromImage: %q is not an image name; build from a template with fromTemplate", base)
			return
		}
	}
	if strings.ContainsAny(base, " \t\n\r") {
		writeError(w, http.StatusBadRequest, "fromImage: %q is not an image name", base)
		return
	}
	plan, err := g.planBuild(p, req, base, user, workdir)
	if err != nil {
		writeErr(w, err)
		return
	}
	now := time.Now().UTC()
	g.tpls.mu.Lock()
	if b.Status != buildWaiting {
		g.tpls.mu.Unlock()
		writeError(w, http.StatusConflict, "build %q was started already", bid)
		return
	}
	b.Status, b.Updated = buildBuilding, now
	b.Logs = append(b.Logs, logEntryJSON{Timestamp: now, Level: "info", Message: "Building template " + t.Name + " from " + base, Step: stepBase})
	_ = g.tpls.saveLocked()
	g.tpls.mu.Unlock()
	tok := auth.BearerFrom(r.Context())
	g.builds.Go(func() {
		g.runTemplateBuild(auth.WithBearer(context.WithValue(context.Background(), principalKey{}, p), tok), t, b, plan, req)
	})
	w.WriteHeader(http.StatusAccepted)
}

// shownInstr is a generated instruction as the caller wrote the step:
// RUN ["/bin/sh","-c","cmd"] is RUN cmd.
func shownInstr(s string) string {
	const run = `RUN ["/bin/sh","-c",`
	if strings.HasPrefix(s, run) {
		var args []string
		if json.Unmarshal([]byte(strings.TrimPrefix(s, "RUN ")), &args) == nil && len(args) == 3 {
			return "RUN " + args[2]
		}
	}
	return s
}

func noNewline(s string) bool { return !strings.ContainsAny(s, "\n\r\x00") }

// buildLog collects a build's log entries (guarded by the store's lock).
type buildLog struct {
	g     *Gateway
	b     *tplBuild
	plan  *plannedBuild
	step  string // the E2B step running
	nstep int    // its native step
	line  map[string]*bytes.Buffer
	raw   string // the running instruction
	instr string // raw as the caller wrote it
}

func (l *buildLog) addLocked(level, step, msg string) {
	if len(l.b.Logs) >= maxLogEntries {
		return
	}
	if len(l.b.Logs) == maxLogEntries-1 {
		level, msg = "warn", "the log is truncated here"
	}
	l.b.Logs = append(l.b.Logs, logEntryJSON{Timestamp: time.Now().UTC(), Level: level, Message: msg, Step: step})
}

func (l *buildLog) add(level, step, msg string) {
	l.g.tpls.mu.Lock()
	defer l.g.tpls.mu.Unlock()
	l.addLocked(level, step, msg)
}

func (l *buildLog) stepName(n int) string {
	if n >= 1 && n <= len(l.plan.stepOf) {
		return l.plan.stepOf[n-1]
	}
	return stepFinalize
}

func (l *buildLog) event(e BuildEvent) {
	l.g.tpls.mu.Lock()
	defer l.g.tpls.mu.Unlock()
	step := l.stepName(e.Step)
	if e.Stream != "" {
		buf := l.line[e.Stream]
		if buf == nil {
			buf = &bytes.Buffer{}
			l.line[e.Stream] = buf
		}
		buf.Write(e.Data)
		for {
			i := bytes.IndexByte(buf.Bytes(), '\n')
			if i < 0 {
				break
			}
			l.addLocked("info", step, string(buf.Next(i + 1)[:i]))
		}
		return
	}
	l.flushLocked(step)
	switch {
	case !e.Done:
		l.step, l.nstep = step, e.Step
		l.raw, l.instr = e.Instruction, shownInstr(e.Instruction)
		l.addLocked("info", step, fmt.Sprintf("[%d/%d] %s", e.Step, e.Steps, l.instr))
	case e.Cached:
		l.addLocked("info", step, fmt.Sprintf("[%d/%d] CACHED %s", e.Step, e.Steps, shownInstr(e.Instruction)))
	}
}

func (l *buildLog) flushLocked(step string) {
	for _, s := range []string{"stdout", "stderr"} {
		if buf := l.line[s]; buf != nil && buf.Len() > 0 {
			l.addLocked("info", step, buf.String())
			buf.Reset()
		}
	}
}

// runTemplateBuild runs a started build: the native build of its
// Dockerfile, then its tags. A failed build makes nothing.
func (g *Gateway) runTemplateBuild(ctx context.Context, t *tplRecord, b *tplBuild, plan *plannedBuild, req templateBuildStart) {
	l := &buildLog{g: g, b: b, plan: plan, step: stepBase, line: map[string]*bytes.Buffer{}}
	image := tplImagePrefix + t.ID + ":" + b.ID
	fail := func(step, msg string) {
		s := g.tpls
		s.mu.Lock()
		defer s.mu.Unlock()
		l.flushLocked(step)
		l.addLocked("error", step, msg)
		tail := b.Logs[max(0, len(b.Logs)-20):]
		b.Status, b.Updated = buildError, time.Now().UTC()
		b.Reason = &reasonJSON{Message: msg, Step: step, LogEntries: slices.Clone(tail)}
		_ = s.saveLocked()
	}
	ctxFile, err := os.CreateTemp(g.cfg.StateDir, ".context-*.tar")
	if err != nil {
		log.G(ctx).Error("template build context", log.Err(err))
		fail(stepBase, "the build context could not be written (server error)")
		return
	}
	defer func() {
		ctxFile.Close()
		os.Remove(ctxFile.Name())
	}()
	if err := writeContext(ctxFile, plan.archives); err != nil {
		log.G(ctx).Error("template build context", log.Err(err))
		fail(stepBase, "the build context could not be written (server error)")
		return
	}
	size, err := fileSize(ctxFile)
	if err == nil {
		_, err = ctxFile.Seek(0, io.SeekStart)
	}
	if err != nil {
		fail(stepBase, "the build context could not be written (server error)")
		return
	}
	var rd io.Reader
	if len(plan.archives) > 0 {
		rd = ctxFile
	}
	select {
	case g.buildSlots <- struct{}{}:
	default:
		l.add("info", stepBase, "Waiting for a build slot (other builds are running)")
		g.buildSlots <- struct{}{}
	}
	defer func() { <-g.buildSlots }()
	// skip_cache / skipCache (force) and a step's force: the native
	// builder bypasses its cache for the whole build.
	noCache := req.Force || slices.ContainsFunc(req.Steps, func(s templateStep) bool { return s.Force })
	err = g.cfg.Builder.BuildImage(ctx, ImageBuildRequest{
		Name: image, Dockerfile: plan.dockerfile, Context: rd, ContextSize: size, StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd,
		NoCache: noCache,
	}, l.event)
	if err != nil {
		g.tpls.mu.Lock()
		step, nstep, instr, raw := l.step, l.nstep, l.instr, l.raw
		g.tpls.mu.Unlock()
		// The Dockerfile is ours, not the caller's: no line numbers, and
		// the step as the caller wrote it. What is not about the build
		// (the API or node unreachable, ...) is logged, not shown.
		msg := dfLineRe.ReplaceAllString(errdefs.PublicMessage(err), "")
		if !slices.ContainsFunc([]error{errdefs.ErrInvalidArgument, errdefs.ErrDeadlineExceeded, errdefs.ErrResourceExhausted,
			errdefs.ErrNotFound, errdefs.ErrFailedPrecondition, errdefs.ErrPermissionDenied}, func(c error) bool { return errors.Is(err, c) }) {
			log.G(ctx).Warn("e2b: template build failed", "image", image, log.Err(err))
			msg = "the build could not run (a server error); try again"
		}
		switch {
		case raw != "" && strings.HasPrefix(msg, raw+": "):
			msg = instr + strings.TrimPrefix(msg, raw)
		case instr != "" && strings.HasPrefix(msg, "RUN: "):
			msg = instr + strings.TrimPrefix(msg, "RUN")
		}
		if nstep <= 1 && (errdefs.IsNotFound(err) || strings.Contains(msg, "no such image")) {
			fail(stepBase, fmt.Sprintf("the base image %s is not in OpenDsec's image store; OpenDsec does not pull from registries: build from a template here (fromTemplate) or ask the operator to import the image", plan.base))
			return
		}
		fail(step, fmt.Sprintf("build step %s failed: %s", step, msg))
		return
	}
	s := g.tpls
	s.mu.Lock()
	l.flushLocked(stepFinalize)
	now := time.Now().UTC()
	b.Status, b.Updated, b.Image, b.User, b.Workdir = buildReady, now, image, plan.user, plan.workdir
	b.StartCmd, b.ReadyCmd = req.StartCmd, req.ReadyCmd
	for _, tag := range b.Tags {
		t.Tags[tag] = tagRecord{BuildID: b.ID, Created: now}
	}
	t.Updated = now
	l.addLocked("info", stepFinalize, "Build finished: "+t.Name+" ("+strings.Join(b.Tags, ", ")+")")
	stale := t.pruneLocked()
	_ = s.saveLocked()
	s.mu.Unlock()
	g.removeImages(stale)
}

// removeImages removes images of builds no tag names any more, with the
// gateway's own token (removing is the operator's right; the gateway
// checked the principal owns them).
func (g *Gateway) removeImages(images []string) {
	for _, img := range images {
		if err := g.cfg.Builder.RemoveImage(context.Background(), img); err != nil {
			log.G(context.Background()).Warn("e2b: remove template image", "image", img, log.Err(err))
		}
	}
}

// templateBuildStatus is GET /templates/{templateID}/builds/{buildID}/status?logsOffset=&limit=
// → TemplateBuildInfo; only the template's owner sees it.
func (g *Gateway) templateBuildStatus(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	tid, bid := r.PathValue("id"), r.PathValue("buildID")
	offset, limit := 0, 100
	for k, v := range map[string]*int{"logsOffset": &offset, "limit": &limit} {
		if s := r.URL.Query().Get(k); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 {
				writeError(w, http.StatusBadRequest, "%s: %q is not a number", k, s)
				return
			}
			*v = n
		}
	}
	limit = min(max(limit, 0), 100)
	s := g.tpls
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.getLocked(p, tid)
	var b *tplBuild
	if ok {
		b, ok = t.Builds[bid]
	}
	if !ok {
		writeError(w, http.StatusNotFound, "build %q of template %q not found", bid, tid)
		return
	}
	entries := []logEntryJSON{}
	if offset < len(b.Logs) {
		entries = slices.Clone(b.Logs[offset:min(len(b.Logs), offset+limit)])
	}
	out := map[string]any{"templateID": t.ID, "buildID": b.ID, "status": b.Status, "logEntries": entries, "logs": []string{}}
	if b.Reason != nil {
		out["reason"] = b.Reason
	}
	writeJSON(w, http.StatusOK, out)
}

// assignTemplateTags is POST /templates/tags {target: "name:tag", tags}
// → 201 {buildID, tags}: the tags now name target's build.
func (g *Gateway) assignTemplateTags(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Target string   `json:"target"`
		Tags   []string `json:"tags"`
	}
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if req.Target == "" || len(req.Tags) == 0 {
		writeError(w, http.StatusBadRequest, "give target (name:tag) and tags")
		return
	}
	for _, t := range req.Tags {
		if !tagRe.MatchString(t) {
			writeError(w, http.StatusBadRequest, "tags: %q is not a tag (letters, digits, '.', '_', '-')", t)
			return
		}
	}
	p := principal(r.Context())
	t, b, ok := g.tpls.resolve(p, req.Target)
	if !ok {
		writeError(w, http.StatusNotFound, "template %q not found (or its tag names no finished build)", req.Target)
		return
	}
	s := g.tpls
	s.mu.Lock()
	now := time.Now().UTC()
	for _, tag := range req.Tags {
		t.Tags[tag] = tagRecord{BuildID: b.ID, Created: now}
	}
	stale := t.pruneLocked()
	err := s.saveLocked()
	s.mu.Unlock()
	g.removeImages(stale)
	if err != nil {
		writeErr(w, fmt.Errorf("save templates: %w", err))
		return
	}
	writeJSON(w, http.StatusCreated, map[string]any{"buildID": b.ID, "tags": req.Tags})
}

// deleteTemplateTags is DELETE /templates/tags {name, tags} → 204.
func (g *Gateway) deleteTemplateTags(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string   `json:"name"`
		Tags []string `json:"tags"`
	}
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if req.Name == "" || len(req.Tags) == 0 {
		writeError(w, http.StatusBadRequest, "give name and tags")
		return
	}
	p := principal(r.Context())
	s := g.tpls
	s.mu.Lock()
	t, ok := s.getLocked(p, req.Name)
	if !ok {
		s.mu.Unlock()
		writeError(w, http.StatusNotFound, "template %q not found", req.Name)
		return
	}
	for _, tag := range req.Tags {
		if _, ok := t.Tags[tag]; !ok {
			s.mu.Unlock()
			writeError(w, http.StatusNotFound, "template %q has no tag %q", req.Name, tag)
			return
		}
	}
	for _, tag := range req.Tags {
		delete(t.Tags, tag)
	}
	stale := t.pruneLocked()
	err := s.saveLocked()
	s.mu.Unlock()
	g.removeImages(stale)
	if err != nil {
		writeErr(w, fmt.Errorf("save templates: %w", err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// templateTags is GET /templates/{templateID}/tags → [{tag, buildID,
// createdAt}].
func (g *Gateway) templateTags(w http.ResponseWriter, r *http.Request, ref string) {
	t, ok := g.lockOwnTemplate(w, r, ref, nil)
	if !ok {
		return
	}
	defer g.tpls.mu.Unlock()
	type tagJSON struct {
		Tag       string    `json:"tag"`
		BuildID   string    `json:"buildID"`
		CreatedAt time.Time `json:"createdAt"`
	}
	out := []tagJSON{}
	for tag, tr := range t.Tags {
		out = append(out, tagJSON{Tag: tag, BuildID: tr.BuildID, CreatedAt: tr.Created})
	}
	slices.SortFunc(out, func(a, b tagJSON) int { return strings.Compare(a.Tag, b.Tag) })
	writeJSON(w, http.StatusOK, out)
}

// templateSubroute is GET /templates/{id}/{sub}: aliases/{alias} and
// {templateID}/tags share the pattern.
func (g *Gateway) templateSubroute(w http.ResponseWriter, r *http.Request) {
	id, sub := r.PathValue("id"), r.PathValue("sub")
	switch {
	case id == "aliases":
		r.SetPathValue("alias", sub)
		g.templateAlias(w, r)
	case sub == "tags":
		g.templateTags(w, r, id)
	default:
		writeError(w, http.StatusNotFound, "%s %s: no such route", r.Method, r.URL.Path)
	}
}

// listTemplates is GET /templates → the caller's templates (E2B's
// Template), built through this gateway.
func (g *Gateway) listTemplates(w http.ResponseWriter, r *http.Request) {
	out := []map[string]any{}
	for _, t := range g.tpls.list(principal(r.Context())) {
		out = append(out, templateJSON(&t))
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteBuiltTemplate is DELETE /templates/{id} for a template built here:
// its record, tags and images go. Snapshots are deleted as before.
func (g *Gateway) deleteBuiltTemplate(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	s := g.tpls
	var missing func()
	if g.cfg.Snapshots != nil {
		missing = func() { g.deleteTemplate(w, r) }
	}
	t, ok := g.lockOwnTemplate(w, r, id, missing)
	if !ok {
		return
	}
	var images []string
	for _, b := range t.Builds {
		if b.Status == buildBuilding {
			s.mu.Unlock()
			writeError(w, http.StatusConflict, "template %q has a build running; delete it when the build has finished", id)
			return
		}
		if b.Image != "" {
			images = append(images, b.Image)
		}
	}
	delete(s.all, t.ID)
	err := s.saveLocked()
	s.mu.Unlock()
	g.removeImages(images)
	if err != nil {
		writeErr(w, fmt.Errorf("save templates: %w", err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
