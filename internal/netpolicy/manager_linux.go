package netpolicy

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/nftables"
	nlconn "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// persisted is a sandbox's state file.
type persisted struct {
	ID    string `json:"id"`
	Index int    `json:"index"`
	Rules Rules  `json:"rules"`
	// Mode is how the guest attaches; empty in state written before modes
	// existed, which means veth.
	Mode Mode `json:"mode,omitempty"`
	// DomainSets is how many domain sets the installed rules use.
	DomainSets int `json:"domain_sets"`
	// HostIf and NetNSPath are the names Setup gave the sandbox's veth and
	// namespace file. Empty in state written before node IDs were in the
	// names: then they are the names without a node ID (HostIfName("",
	// id)) and the netns_dir of before (legacyNSDir).
	HostIf    string `json:"host_if,omitempty"`
	NetNSPath string `json:"netns_path,omitempty"`
	// Counted says that the sandbox's egress counter was made with its
	// first rules, so it has counted every packet of the sandbox; false in
	// state written before the counter (Recover makes one that counts
	// from then on).
	Counted bool `json:"counted,omitempty"`
}

type sandbox struct {
	// mu serialises rule changes and DNS admissions of this sandbox.
	mu      sync.Mutex
	st      persisted  // guarded by mu
	rules   []rule     // guarded by mu
	learned learnedSet // guarded by mu
	// queries is the sandbox's DNS rate limit; refused counts queries it
	// refused since the last log line about them (at loggedAt).
	queries  bucket    // guarded by mu
	refused  int       // guarded by mu
	loggedAt time.Time // guarded by mu
	// gen changes (under mu) whenever the sandbox's domain sets are
	// rebuilt or removed, so queued element changes for the old ones are
	// dropped.
	gen atomic.Uint64
	// ctUncounted is set when the node's conntrack may hold flows of the
	// sandbox that its egress counter does not show: a node before the
	// counter made it (its state is not Counted), and Recover made the
	// counter anew. Teardown then flushes whatever the counter says.
	ctUncounted bool // guarded by mu
	net         Network
}

// Manager owns the network of every sandbox on a node.
type Manager struct {
	cfg Config
	// legacyNSDir is where namespace files of sandboxes set up before node
	// IDs were in the names are: the configured netns_dir, or the old
	// default.
	legacyNSDir string
	pool        netip.Prefix
	alloc       *allocator
	nl          *netlink.Handle
	// v6conf is the node namespace's /proc/sys/net/ipv6/conf, open (-1:
	// the kernel has no IPv6): each node-side veth gets IPv6 off through
	// it before it goes up (hostIPv6Off).
	v6conf int

	nftMu sync.Mutex // serialises nft batches
	nft   *nftState  // guarded by nftMu
	// nftQueue holds the sandboxes whose rules wait for nftMu: whoever
	// gets it applies all of them in one transaction (apply).
	nftQueueMu sync.Mutex
	nftQueue   []*nftApply // guarded by nftQueueMu
	// nftCommits counts the transactions apply made (tests).
	nftCommits atomic.Int64

	mu        sync.Mutex
	sandboxes map[string]*sandbox     // guarded by mu
	byAddr    map[netip.Addr]*sandbox // guarded by mu

	dns *dnsProxy

	// nftQ feeds flushLoop the DNS answers' element changes; stop ends
	// flushLoop and sweepLoop (bg).
	nftQ chan nftReq
	stop chan struct{}
	bg   sync.WaitGroup

	learnedTotal   atomic.Int64
	dnsEvicted     atomic.Uint64
	dnsRateLimited atomic.Uint64
	dnsPrivate     atomic.Uint64
	nftFlushes     atomic.Uint64
	// ctFlushes counts teardowns that looked for conntrack entries of their
	// sandbox, ctSkipped those whose egress counter showed none to look for
	// (tests, metrics).
	ctFlushes atomic.Uint64
	ctSkipped atomic.Uint64
}

// New prepares the node (nft table, DNS address, forwarding), loads the
// sandboxes recorded in cfg.StateDir and starts the DNS proxy. It leaves
// running sandboxes' networks alone; call Recover to drop the dead ones.
func New(ctx context.Context, cfg Config, dataDir string) (*Manager, error) {
	legacyNSDir := cmp.Or(cfg.NetNSDir, DefaultNetNSDir)
	cfg = cfg.withDefaults(dataDir)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Manager{cfg: cfg, legacyNSDir: legacyNSDir, pool: netip.MustParsePrefix(cfg.Pool), sandboxes: map[string]*sandbox{}, byAddr: map[netip.Addr]*sandbox{},
		nftQ: make(chan nftReq, 1024), stop: make(chan struct{}), v6conf: -1}
	var err error
	if m.alloc, err = newAllocator(filepath.Join(cfg.StateDir, "addrs"), m.pool); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(cfg.StateDir, "sandboxes"), 0o700); err != nil {
		return nil, fmt.Errorf("create state dir: %w", err)
	}
	nodeNS := netns.None()
	if cfg.NodeNetNS != "" {
		if nodeNS, err = netns.GetFromPath(cfg.NodeNetNS); err != nil {
			return nil, fmt.Errorf("open node netns: %w", err)
		}
		defer nodeNS.Close()
		m.nl, err = netlink.NewHandleAt(nodeNS)
	} else {
		m.nl, err = netlink.NewHandle()
	}
	if err != nil {
		return nil, fmt.Errorf("open netlink: %w", err)
	}
	var opts []nftables.ConnOption
	if cfg.NodeNetNS != "" {
		opts = append(opts, nftables.WithNetNSFd(int(nodeNS)))
	}
	// A lasting connection keeps its socket in the node namespace. Its
	// receive buffer is large: google/nftables v0.3.0's Flush waits for one
	// ack per message, and acks the kernel dropped for want of room
	// (ENOBUFS, which ends that Flush early) are then missing from the next
	// one, which waits for them forever; a group commit of many sandboxes
	// sends many messages.
	opts = append(opts, nftables.WithSockOptions(bigReceiveBuffer))
	conn, err := nftables.New(append(opts, nftables.AsLasting())...)
	if err != nil {
		m.nl.Close()
		return nil, fmt.Errorf("open nftables: %w", err)
	}
	m.nft = &nftState{c: conn, table: &nftables.Table{Name: TableName(cfg.NodeID), Family: nftables.TableFamilyINet}, pool: m.pool, dns: m.alloc.dnsAddr()}
	fail := func(err error) (*Manager, error) {
		m.Close()
		return nil, err
	}
	if err := inNetNS(cfg.NodeNetNS, func() error {
		if err := writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
		fd, err := unix.Open("/proc/sys/net/ipv6/conf", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		switch {
		case err == nil:
			m.v6conf = fd
		case !errors.Is(err, unix.ENOENT):
			return fmt.Errorf("open the node namespace's /proc/sys/net/ipv6/conf: %w", err)
		}
		return nil
	}); err != nil {
		return fail(err)
	}
	if err := m.ensureDNSLink(); err != nil {
		return fail(err)
	}
	if m.dns, err = listenDNS(ctx, m); err != nil {
		return fail(err)
	}
	m.nftMu.Lock()
	err = m.nft.ensureBase()
	m.nftMu.Unlock()
	if err != nil {
		return fail(err)
	}
	if err := m.load(); err != nil {
		return fail(err)
	}
	m.bg.Add(2)
	go m.flushLoop()
	go m.sweepLoop()
	if err := m.dns.serve(ctx); err != nil {
		return fail(err)
	}
	return m, nil
}

// Close stops the DNS proxy. Sandboxes keep their network and policy.
func (m *Manager) Close() error {
	var err error
	if m.dns != nil {
		err = m.dns.close()
	}
	if m.stop != nil {
		select {
		case <-m.stop:
		default:
			close(m.stop)
		}
		m.bg.Wait()
	}
	if m.nft != nil {
		err = errors.Join(err, m.nft.c.CloseLasting())
	}
	if m.nl != nil {
		m.nl.Close()
	}
	if m.v6conf >= 0 {
		unix.Close(m.v6conf)
		m.v6conf = -1
	}
	return err
}

// hostIPv6Off turns IPv6 off on the node's end of a sandbox veth (down,
// just made): it gets no link-local address, no routes and no addrconf
// work. With IPv6 on, each of them added routes to the node namespace's
// IPv6 table, which the kernel walks whole (fib6_clean_all) on every link
// change there: every create and stop cost O(sandboxes) (about 1.3 ms
// per create with 1000 sandboxes on the node). The sandbox side has IPv6
// off already; nothing on the node speaks IPv6 to a sandbox.
func (m *Manager) hostIPv6Off(ifName string) error {
	if m.v6conf < 0 {
		return nil
	}
	fd, err := unix.Openat(m.v6conf, ifName+"/disable_ipv6", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("turn IPv6 off on veth %s: %w", ifName, err)
	}
	defer unix.Close(fd)
	// The kernel takes RTNL for this write with a trylock and restarts
	// it while another holds RTNL: keep the node's own users off (rtnlMu).
	rtnlMu.Lock()
	_, err = unix.Write(fd, []byte("1"))
	rtnlMu.Unlock()
	if err != nil {
		return fmt.Errorf("turn IPv6 off on veth %s: %w", ifName, err)
	}
	return nil
}

// DNSAddr is the DNS proxy's address on the node. Guests ask their gateway
// (Network.DNS), which their namespace forwards here.
func (m *Manager) DNSAddr() netip.Addr { return m.alloc.dnsAddr() }

// ensureDNSLink puts the DNS proxy's address on the node's loopback (not
// every kernel has the dummy link type), where every sandbox routes to it
// through its gateway.
func (m *Manager) ensureDNSLink() error {
	link, err := m.nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	addr := &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(m.alloc.dnsAddr(), 32))}
	if err := m.nl.AddrReplace(link, addr); err != nil {
		return fmt.Errorf("add dns address: %w", err)
	}
	if err := m.nl.LinkSetUp(link); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

// owns reports whether sandbox id is this node's: its ID starts with the
// node's. What other nodes made in places nodes share (the network
// namespace, a netns_dir) is never this node's to remove.
func (m *Manager) owns(id string) bool { return strings.HasPrefix(id, m.cfg.NodeID) }

// ifNames are the names sb's veth may have: the one it was given (when
// known), and this node's and the pre-node-ID name of its ID.
func (m *Manager) ifNames(sb *sandbox) []string {
	return uniq(sb.net.HostIf, HostIfName(m.cfg.NodeID, sb.st.ID), HostIfName("", sb.st.ID))
}

// nsPaths are the paths sb's namespace file may have, likewise.
func (m *Manager) nsPaths(sb *sandbox) []string {
	return uniq(sb.net.NetNSPath, m.nsPath(sb.st.ID), filepath.Join(m.legacyNSDir, sb.st.ID))
}

func uniq(ss ...string) []string {
	var out []string
	for _, s := range ss {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// Planned returns what Setup will give id in veth mode, except HostAddr and
// HostGateway, so a caller can prepare the container's config while Setup
// runs.
func (m *Manager) Planned(id string) Network { return m.PlannedWith(id, SetupOptions{}) }

// PlannedWith is Planned for the given options (an invalid mode plans veth;
// SetupWith refuses it).
func (m *Manager) PlannedWith(id string, opts SetupOptions) Network {
	mode, err := opts.mode()
	if err != nil {
		mode = ModeVeth
	}
	n := guestNetwork(id, m.nsPath(id), mode)
	n.HostIf = HostIfName(m.cfg.NodeID, id)
	return n
}

func (m *Manager) nsPath(id string) string { return filepath.Join(m.cfg.NetNSDir, id) }
func (m *Manager) statePath(id string) string {
	return filepath.Join(m.cfg.StateDir, "sandboxes", id+".json")
}

func validID(id string) error {
	if id == "" || len(id) > 64 {
		return errdefs.Invalid("sandbox_id", "%q must be 1 to 64 characters of [a-z0-9]", id)
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return errdefs.Invalid("sandbox_id", "%q must be 1 to 64 characters of [a-z0-9]", id)
		}
	}
	return nil
}

func (m *Manager) netOf(id string, index int, mode Mode) Network {
	n := m.PlannedWith(id, SetupOptions{Mode: mode})
	n.HostGateway, n.HostAddr = m.alloc.pair(index)
	return n
}

func (m *Manager) writeState(st persisted) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("encode sandbox network state: %w", err)
	}
	p := m.statePath(st.ID)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write sandbox network state: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return fmt.Errorf("write sandbox network state: %w", err)
	}
	return nil
}

// load reads every state file into memory.
func (m *Manager) load() error {
	ents, err := os.ReadDir(filepath.Join(m.cfg.StateDir, "sandboxes"))
	if err != nil {
		return fmt.Errorf("list sandbox network state: %w", err)
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		b, err := os.ReadFile(m.statePath(id))
		if err != nil {
			return fmt.Errorf("read sandbox network state: %w", err)
		}
		var st persisted
		if err := json.Unmarshal(b, &st); err != nil || st.ID != id {
			// A torn file: keep the sandbox so Recover can remove it.
			st = persisted{ID: id}
		}
		sb := &sandbox{st: st, net: Network{ID: id}, ctUncounted: !st.Counted}
		sb.rules, _ = resolve(st.Rules, m.cfg.RuleSets)
		m.sandboxes[id] = sb
		if st.Index > 0 {
			sb.net = m.netOf(id, st.Index, st.Mode)
			sb.net.HostIf = cmp.Or(st.HostIf, HostIfName("", id))
			sb.net.NetNSPath = cmp.Or(st.NetNSPath, filepath.Join(m.legacyNSDir, id))
			m.byAddr[sb.net.HostAddr] = sb
		}
	}
	return nil
}

// defaults applies the configured default rule sets to an empty request.
func (m *Manager) defaults(r Rules) Rules {
	if len(r.RuleSets) == 0 && len(r.Allow) == 0 && r.RuleSets == nil {
		r.RuleSets = append([]string(nil), m.cfg.DefaultRuleSets...)
	}
	return r
}

// Setup is SetupWith in veth mode.
func (m *Manager) Setup(ctx context.Context, id string, rules Rules) (Network, error) {
	return m.SetupWith(ctx, id, rules, SetupOptions{})
}

// SetupWith creates the sandbox's network namespace at NetNSPath with the
// guest configuration every sandbox has, its veth to the node with the
// sandbox's own host address, the NAT between the two, and installs rules
// (the node's default rule sets when rules is the zero value). In tap mode
// the guest configuration is for a VM behind tap0. On error nothing is
// left behind.
func (m *Manager) SetupWith(ctx context.Context, id string, rules Rules, opts SetupOptions) (Network, error) {
	if err := validID(id); err != nil {
		return Network{}, err
	}
	mode, err := opts.mode()
	if err != nil {
		return Network{}, err
	}
	rules = m.defaults(rules)
	resolved, err := resolve(rules, m.cfg.RuleSets)
	if err != nil {
		return Network{}, err
	}
	m.mu.Lock()
	if _, ok := m.sandboxes[id]; ok {
		m.mu.Unlock()
		return Network{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already has a network", id)
	}
	sb := &sandbox{}
	m.sandboxes[id] = sb
	sb.mu.Lock()
	m.mu.Unlock()
	defer sb.mu.Unlock()

	domainSets := len(domainRules(resolved))
	stateOf := func(idx int) persisted {
		n := m.netOf(id, idx, mode)
		return persisted{ID: id, Index: idx, Rules: rules, Mode: mode, DomainSets: domainSets,
			HostIf: n.HostIf, NetNSPath: n.NetNSPath, Counted: true}
	}
	// The allocation file holds the sandbox's network state: setup links
	// it as the state file.
	idx, err := m.alloc.allocWith(id, func(idx int) ([]byte, error) {
		b, err := json.Marshal(stateOf(idx))
		if err != nil {
			return nil, fmt.Errorf("encode sandbox network state: %w", err)
		}
		return b, nil
	})
	if err != nil {
		m.mu.Lock()
		delete(m.sandboxes, id)
		m.mu.Unlock()
		return Network{}, err
	}
	sb.net = m.netOf(id, idx, mode)
	sb.st = stateOf(idx)
	sb.rules = resolved
	if err := m.setup(ctx, sb); err != nil {
		cctx := context.WithoutCancel(ctx)
		if terr := m.teardown(cctx, sb); terr != nil {
			log.G(ctx).Warn("clean up failed network setup", "sandbox.id", id, "error", terr)
		}
		m.mu.Lock()
		delete(m.sandboxes, id)
		m.mu.Unlock()
		return Network{}, fmt.Errorf("set up network of sandbox %s: %w", id, err)
	}
	m.mu.Lock()
	m.byAddr[sb.net.HostAddr] = sb
	m.mu.Unlock()
	return sb.net, nil
}

// setup builds everything; sb.mu is held.
func (m *Manager) setup(ctx context.Context, sb *sandbox) error {
	// The state file comes first: after a crash anywhere below, Recover
	// finds the sandbox by it. It is the allocation file (which holds
	// sb.st) under a second name: no file to write.
	if err := os.Link(m.alloc.path(sb.st.Index), m.statePath(sb.st.ID)); err != nil {
		if err := m.writeState(sb.st); err != nil {
			return err
		}
	}
	n := sb.net
	tap := n.Mode == ModeTap
	// The namespace's mount point is one more name of the allocation
	// file, where the file systems allow.
	err := createNetNSOn(n.NetNSPath, m.alloc.path(sb.st.Index), func() error {
		if err := sandboxNSSetup(); err != nil {
			return err
		}
		if !tap {
			return nil
		}
		// The namespace routes between the VM and the node.
		if err := writeNSSysctl("net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
		// A tap is made by an ioctl in the calling thread's namespace.
		t := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: tapIf}, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR}
		if err := netlink.LinkAdd(t); err != nil {
			return fmt.Errorf("add tap: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ns, err := netns.GetFromPath(n.NetNSPath)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer ns.Close()
	// Both ends have fixed MACs and permanent neighbour entries for each
	// other: nothing on the veth ever waits for ARP.
	ethMAC := guestMAC
	if tap {
		ethMAC = transportMAC
	}
	// The node's end goes up once its IPv6 is off (hostIPv6Off); LinkAdd
	// fills in its index.
	veth := &netlink.Veth{
		LinkAttrs:        netlink.LinkAttrs{Name: n.HostIf, Alias: n.ID, HardwareAddr: hw(gatewayMAC)},
		PeerName:         sandboxIf,
		PeerHardwareAddr: hw(ethMAC),
		PeerNamespace:    netlink.NsFd(int(ns)),
	}
	// The links' netlink requests (all under RTNL) stay off RTNL while a
	// disable_ipv6 is written (rtnlMu).
	rtnlMu.RLock()
	err = m.nl.LinkAdd(veth)
	rtnlMu.RUnlock()
	if err != nil {
		return fmt.Errorf("add veth: %w", err)
	}
	if veth.Index == 0 {
		return errdefs.New(errdefs.ErrInternal, "veth %s has no index after its creation", n.HostIf)
	}
	if err := m.hostIPv6Off(n.HostIf); err != nil {
		return err
	}
	// Each netlink request holds rtnlMu on its own: a disable_ipv6 write
	// waits for one request, not a whole sequence of them.
	var in *netlink.Handle
	err = func() error {
		host := netlink.Link(veth)
		if err := rtnlRead(func() error { return m.nl.LinkSetUp(host) }); err != nil {
			return fmt.Errorf("set veth up: %w", err)
		}
		if err := rtnlRead(func() error { return m.nl.LinkSetAlias(host, n.ID) }); err != nil {
			return fmt.Errorf("label veth: %w", err)
		}
		if err := rtnlRead(func() error {
			return m.nl.AddrAdd(host, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(n.HostGateway, 31))})
		}); err != nil {
			return fmt.Errorf("address veth: %w", err)
		}
		if err := rtnlRead(func() error { return m.nl.NeighSet(permanentNeigh(host, n.HostAddr, ethMAC)) }); err != nil {
			return fmt.Errorf("add neighbour of veth: %w", err)
		}
		in, err = netlink.NewHandleAt(ns)
		if err != nil {
			return fmt.Errorf("open sandbox netlink: %w", err)
		}
		var peer netlink.Link
		if err := rtnlRead(func() (err error) { peer, err = in.LinkByName(sandboxIf); return err }); err != nil {
			return fmt.Errorf("find sandbox veth: %w", err)
		}
		if tap {
			return rtnlRead(func() error { return m.setupTapSide(in, peer, n) })
		}
		return m.setupVethSide(in, peer)
	}()
	if in != nil {
		defer in.Close()
	}
	if err != nil {
		return err
	}
	if err := m.setupNAT(ns, n); err != nil {
		return err
	}
	if err := m.apply(sb, 0, true); err != nil {
		return err
	}
	// A veth end drops what it sends until the kernel's link watcher has
	// seen its carrier (its queue is a no-op until then), on both ends; a
	// sandbox whose first SYN vanished would wait a whole retransmit (1 s).
	if err := waitOperUp(ctx, in, sandboxIf); err != nil {
		return err
	}
	return waitOperUp(ctx, m.nl, n.HostIf)
}

func permanentNeigh(l netlink.Link, ip netip.Addr, mac [6]byte) *netlink.Neigh {
	return &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT, IP: ip.AsSlice(), HardwareAddr: hw(mac)}
}

// setupVethSide gives eth0 the guest configuration: the guest lives in the
// namespace.
func (m *Manager) setupVethSide(in *netlink.Handle, eth netlink.Link) error {
	if err := rtnlRead(func() error { return in.AddrAdd(eth, &netlink.Addr{IPNet: prefixNet(guestPrefix)}) }); err != nil {
		return fmt.Errorf("address sandbox veth: %w", err)
	}
	if err := rtnlRead(func() error { return in.LinkSetUp(eth) }); err != nil {
		return fmt.Errorf("set sandbox veth up: %w", err)
	}
	// The gateway is the node's end of the veth, which holds no guest
	// address: only its MAC answers for it.
	if err := rtnlRead(func() error { return in.NeighSet(permanentNeigh(eth, guestGateway, gatewayMAC)) }); err != nil {
		return fmt.Errorf("add gateway neighbour: %w", err)
	}
	if err := rtnlRead(func() error {
		return in.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: guestGateway.AsSlice()})
	}); err != nil {
		return fmt.Errorf("add default route: %w", err)
	}
	return nil
}

// setupTapSide makes the namespace the VM's router: tap0 is the guest's
// gateway, eth0 (no address of its own) leads to the node.
func (m *Manager) setupTapSide(in *netlink.Handle, eth netlink.Link, n Network) error {
	if err := in.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set sandbox veth up: %w", err)
	}
	if err := in.NeighSet(permanentNeigh(eth, n.HostGateway, gatewayMAC)); err != nil {
		return fmt.Errorf("add node neighbour: %w", err)
	}
	if err := in.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: n.HostGateway.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}); err != nil {
		return fmt.Errorf("add default route: %w", err)
	}
	t, err := in.LinkByName(tapIf)
	if err != nil {
		return fmt.Errorf("find tap: %w", err)
	}
	if err := in.LinkSetHardwareAddr(t, hw(gatewayMAC)); err != nil {
		return fmt.Errorf("set tap mac: %w", err)
	}
	if err := in.AddrAdd(t, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(guestGateway, guestPrefix.Bits()))}); err != nil {
		return fmt.Errorf("address tap: %w", err)
	}
	if err := in.NeighSet(permanentNeigh(t, guestPrefix.Addr(), guestMAC)); err != nil {
		return fmt.Errorf("add guest neighbour: %w", err)
	}
	// Without a VM attached the tap has no carrier; it is up all the same.
	if err := in.LinkSetUp(t); err != nil {
		return fmt.Errorf("set tap up: %w", err)
	}
	return nil
}

func waitOperUp(ctx context.Context, h *netlink.Handle, name string) error {
	ctx, cancel := context.WithTimeoutCause(ctx, 5*time.Second, errors.New("veth carrier did not come up within 5s"))
	defer cancel()
	for delay := 100 * time.Microsecond; ; delay = min(2*delay, 10*time.Millisecond) {
		l, err := h.LinkByName(name)
		if err != nil {
			return fmt.Errorf("find sandbox veth: %w", err)
		}
		if l.Attrs().OperState == netlink.OperUp {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for veth carrier: %w", context.Cause(ctx))
		case <-time.After(delay):
		}
	}
}

// nftApply is one sandbox's rules waiting for an nft transaction.
type nftApply struct {
	spec sandboxSpec
	now  time.Time
	// done and err are set under nftMu by the apply that ran it.
	done bool
	err  error
}

// apply installs sb's rules; sb.mu is held.
//
// Applies that wait for each other go in one transaction (group commit):
// every nftables commit that adds a jump validates the whole table, all
// sandboxes' chains (nft_chain_validate), so a burst of creates paid that
// once per sandbox. Now the apply that gets nftMu takes every apply
// queued behind it as well; if that transaction fails, each is applied
// alone, so one bad sandbox fails only itself.
func (m *Manager) apply(sb *sandbox, oldSets int, flush bool) error {
	now := time.Now()
	m.learnedTotal.Add(-int64(sb.learned.prune(now)))
	live := sb.learned.list(now)
	req := &nftApply{spec: sandboxSpec{
		id: sb.st.ID, index: sb.st.Index, hostIf: sb.net.HostIf, addr: sb.net.HostAddr, rules: sb.rules,
		oldDomainSets: oldSets, flushSets: flush, seed: live,
	}, now: now}
	m.nftQueueMu.Lock()
	m.nftQueue = append(m.nftQueue, req)
	m.nftQueueMu.Unlock()
	m.nftMu.Lock()
	defer m.nftMu.Unlock()
	if req.done {
		return req.err // another apply took it
	}
	m.nftQueueMu.Lock()
	batch := m.nftQueue
	m.nftQueue = nil
	m.nftQueueMu.Unlock()
	for len(batch) > 0 {
		k := min(len(batch), maxGroupCommit)
		m.applyBatch(batch[:k])
		batch = batch[k:]
	}
	return req.err
}

// nftReceiveBuffer is the nftables socket's receive buffer: room for the
// acks of a transaction of maxGroupCommit sandboxes many times over.
const nftReceiveBuffer = 8 << 20

// bigReceiveBuffer sets the nftables socket's receive buffer to
// nftReceiveBuffer, past net.core.rmem_max (SO_RCVBUFFORCE: the node runs
// as root), else as large as that allows.
func bigReceiveBuffer(c *nlconn.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("nftables socket: %w", err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, nftReceiveBuffer)
		if serr != nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, nftReceiveBuffer)
		}
	}); err != nil {
		return fmt.Errorf("nftables socket: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("nftables socket receive buffer: %w", serr)
	}
	return nil
}

// maxGroupCommit bounds the sandboxes of one group commit, so one
// transaction's acks stay far below the socket's receive buffer.
const maxGroupCommit = 16

// applyBatch applies batch (which is not empty) in one transaction;
// nftMu is held.
func (m *Manager) applyBatch(batch []*nftApply) {
	defer func() {
		for _, r := range batch {
			r.done = true
		}
	}()
	if len(batch) == 1 {
		m.nftCommits.Add(1)
		batch[0].err = m.nft.applySandbox(batch[0].spec, batch[0].now)
		return
	}
	var queued []*nftApply
	for _, r := range batch {
		if r.err = m.nft.addSandbox(r.spec, r.now); r.err == nil {
			queued = append(queued, r)
		}
	}
	m.nftCommits.Add(1)
	err := m.nft.flush()
	if err == nil {
		return
	}
	// The transaction changed nothing: each alone, so the error is its own.
	for _, r := range queued {
		m.nftCommits.Add(1)
		r.err = m.nft.applySandbox(r.spec, r.now)
	}
}

// SetRules replaces a running sandbox's rules in one nftables transaction.
// Connections the new rules do not allow stop at their next packet.
// Invalid rules change nothing.
func (m *Manager) SetRules(ctx context.Context, id string, rules Rules) error {
	resolved, err := resolve(rules, m.cfg.RuleSets)
	if err != nil {
		return err
	}
	sb, err := m.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	st := sb.st
	st.Rules = rules
	st.DomainSets = len(domainRules(resolved))
	if err := m.writeState(st); err != nil {
		return err
	}
	old, oldRules := sb.st, sb.rules
	sb.st, sb.rules = st, resolved
	sb.gen.Add(1)
	if err := m.apply(sb, old.DomainSets, true); err != nil {
		sb.st, sb.rules = old, oldRules
		if werr := m.writeState(old); werr != nil {
			log.G(ctx).Warn("restore sandbox network state", "sandbox.id", id, "error", werr)
		}
		return err
	}
	// Connections the old rules allowed and the new ones do not are cut by
	// deleting their conntrack entries, so "established" no longer lets
	// them through; allowed ones keep their entries (and NAT mappings).
	pol := m.policyOf(sb)
	m.flushConntrack(ctx, sb.net.HostAddr, func(dst netip.Addr, proto uint8, port uint16) bool {
		return !pol.allows(dst, proto, port, time.Now())
	})
	return nil
}

func (m *Manager) policyOf(sb *sandbox) flowPolicy {
	return flowPolicy{rules: sb.rules, learned: sb.learned.list(time.Now()), dns: m.alloc.dnsAddr(), pool: m.pool, explicit: m.nft.protectedExplicit}
}

// ctFilter matches flows from src whose destination cut reports true.
type ctFilter struct {
	src netip.Addr
	cut func(dst netip.Addr, proto uint8, port uint16) bool
}

func (f ctFilter) MatchConntrackFlow(fl *netlink.ConntrackFlow) bool {
	s, ok := netip.AddrFromSlice(fl.Forward.SrcIP)
	if !ok || s.Unmap() != f.src {
		return false
	}
	d, ok := netip.AddrFromSlice(fl.Forward.DstIP)
	if !ok {
		return false
	}
	return f.cut(d.Unmap(), fl.Forward.Protocol, fl.Forward.DstPort)
}

// flushConntrack forgets tracked connections from addr that cut selects.
func (m *Manager) flushConntrack(ctx context.Context, addr netip.Addr, cut func(netip.Addr, uint8, uint16) bool) {
	if _, err := m.nl.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, ctFilter{src: addr, cut: cut}); err != nil {
		log.G(ctx).Warn("flush conntrack of sandbox", "addr", addr.String(), "error", err)
	}
}

// Rules returns the rules a sandbox runs with.
func (m *Manager) Rules(id string) (Rules, error) {
	sb, err := m.get(id)
	if err != nil {
		return Rules{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.st.Rules, nil
}

// Get returns a sandbox's network.
func (m *Manager) Get(id string) (Network, error) {
	sb, err := m.get(id)
	if err != nil {
		return Network{}, err
	}
	return sb.net, nil
}

func (m *Manager) get(id string) (*sandbox, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	sb, ok := m.sandboxes[id]
	if !ok {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s has no network on this node", id)
	}
	return sb, nil
}

func (m *Manager) bySource(a netip.Addr) *sandbox {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.byAddr[a]
}

// Teardown removes everything of a sandbox. Removing what is already gone
// is not an error.
func (m *Manager) Teardown(ctx context.Context, id string) error {
	if err := validID(id); err != nil {
		return err
	}
	m.mu.Lock()
	sb, ok := m.sandboxes[id]
	m.mu.Unlock()
	if !ok {
		// Only leftovers are left to find: no address is known.
		sb = &sandbox{st: persisted{ID: id}, net: Network{ID: id}}
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err := m.teardown(ctx, sb); err != nil {
		return err
	}
	m.mu.Lock()
	delete(m.sandboxes, id)
	if m.byAddr[sb.net.HostAddr] == sb {
		delete(m.byAddr, sb.net.HostAddr)
	}
	m.mu.Unlock()
	return nil
}

// teardown removes sb's pieces in reverse order of setup; sb.mu is held.
func (m *Manager) teardown(ctx context.Context, sb *sandbox) error {
	id := sb.st.ID
	var errs []error
	sb.gen.Add(1)
	m.learnedTotal.Add(-int64(sb.learned.len()))
	sb.learned = learnedSet{}
	ifs := m.ifNames(sb)
	// The veth goes first: once it is gone no packet of the sandbox reaches
	// the node, so its egress counter is final, and none passes unjudged
	// while its rules are removed.
	rtnlMu.RLock()
	for _, name := range ifs {
		if l, err := m.nl.LinkByName(name); err == nil {
			if err := m.nl.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("delete veth: %w", err))
			}
		}
	}
	rtnlMu.RUnlock()
	// The node's conntrack entries from the sandbox's host address must go
	// before the address is allocated again, or the next sandbox there
	// would inherit the flows its rules allowed ("established" passes). A
	// sandbox that never sent a packet to the node (its egress chain counts
	// every one) has none: no dump, which walks the kernel's whole
	// conntrack hash (every namespace's, all its buckets) whatever it
	// returns.
	addr := sb.net.HostAddr
	flushCT := addr.IsValid()
	m.nftMu.Lock()
	if flushCT && len(errs) == 0 && !sb.ctUncounted && sb.st.Index > 0 {
		pkts, err := m.nft.egressPackets(id, sb.st.Index)
		flushCT = err != nil || pkts > 0
	}
	err := m.nft.removeSandbox(id, sb.st.Index, ifs, max(sb.st.DomainSets, 16))
	m.nftMu.Unlock()
	errs = append(errs, err)
	for _, p := range m.nsPaths(sb) {
		errs = append(errs, removeNetNS(p))
	}
	if addr.IsValid() && !flushCT {
		m.ctSkipped.Add(1)
	}
	if flushCT {
		m.ctFlushes.Add(1)
		// Filtered in the kernel: not a dump of the node's whole table.
		if _, err := conntrackDeleteFrom(m.cfg.NodeNetNS, addr); err != nil {
			log.G(ctx).Warn("flush conntrack of sandbox", "addr", addr.String(), "error", err)
		}
	}
	if sb.st.Index > 0 {
		errs = append(errs, m.alloc.release(sb.st.Index, id))
	} else {
		all, err := m.alloc.list()
		errs = append(errs, err)
		for idx, owner := range all {
			if owner == id {
				// An allocation without state (a crash between the two):
				// its address is known only here.
				if _, a := m.alloc.pair(idx); a.IsValid() {
					m.ctFlushes.Add(1)
					if _, err := conntrackDeleteFrom(m.cfg.NodeNetNS, a); err != nil {
						log.G(ctx).Warn("flush conntrack of sandbox", "addr", a.String(), "error", err)
					}
				}
				errs = append(errs, m.alloc.release(idx, id))
			}
		}
	}
	if err := os.Remove(m.statePath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove sandbox network state: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("tear down network of sandbox %s: %w", id, err)
	}
	return nil
}

// RecoverReport says what Recover did.
type RecoverReport struct {
	Kept    []string
	Removed []string
}

// Recover runs after a node restart: sandboxes live reports as running keep
// their network (their rules are reinstalled without dropping what DNS
// admitted); everything else this node made — state, allocations, veths,
// nft chains and sets, netns files — is removed. Veths and namespace files
// of sandboxes that are not this node's (their IDs start with another
// node's ID) are left alone, whoever made them. Rules a node left in the
// table of before node IDs were in the names ("opendsec") move to its own
// table: its own chains there go, and the table too once no other node's
// are in it.
func (m *Manager) Recover(ctx context.Context, live func(id string) bool) (RecoverReport, error) {
	var rep RecoverReport
	var errs []error
	owners := map[string]bool{}
	m.mu.Lock()
	for id := range m.sandboxes {
		owners[id] = true
	}
	m.mu.Unlock()
	links, err := m.nl.LinkList()
	if err != nil {
		return rep, fmt.Errorf("list links: %w", err)
	}
	for _, l := range links {
		a := l.Attrs()
		if l.Type() == "veth" && a.Alias != "" && m.owns(a.Alias) &&
			(HostIfName(m.cfg.NodeID, a.Alias) == a.Name || HostIfName("", a.Alias) == a.Name) {
			owners[a.Alias] = true
		}
	}
	m.nftMu.Lock()
	nftOwners, err := m.nft.leftovers()
	// Sandboxes with rules in the node table itself: the layout before
	// shards.
	unsharded := map[string]int{}
	if err == nil {
		err = m.nft.leftoversIn(m.nft.table, unsharded)
	}
	m.nftMu.Unlock()
	if err != nil {
		return rep, err
	}
	for id := range nftOwners {
		owners[id] = true
	}
	for _, dir := range uniq(m.cfg.NetNSDir, m.legacyNSDir) {
		if ents, err := os.ReadDir(dir); err == nil {
			for _, e := range ents {
				if m.owns(e.Name()) {
					owners[e.Name()] = true
				}
			}
		}
	}
	allocs, err := m.alloc.list()
	if err != nil {
		return rep, err
	}
	for _, id := range allocs {
		owners[id] = true
	}
	for id := range owners {
		if validID(id) != nil {
			continue
		}
		if live(id) {
			sb, err := m.get(id)
			if err != nil {
				errs = append(errs, fmt.Errorf("sandbox %s is running but has no network state", id))
				continue
			}
			sb.mu.Lock()
			err = m.apply(sb, sb.st.DomainSets, false)
			if sets, ok := unsharded[id]; ok && err == nil {
				err = m.moveToShard(sb, sets)
			}
			sb.mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				continue
			}
			rep.Kept = append(rep.Kept, id)
			continue
		}
		if err := m.Teardown(ctx, id); err != nil {
			errs = append(errs, err)
			continue
		}
		rep.Removed = append(rep.Removed, id)
	}
	if err := m.dropLegacyTable(); err != nil {
		errs = append(errs, err)
	}
	return rep, errors.Join(errs...)
}

// moveToShard finishes moving a live sandbox's rules of the layout before
// shards, now applied in its shard, out of the node table: what DNS
// admitted into its old domain sets is copied into the new ones (with the
// time it has left), and the old chains, sets and map entries go, in one
// transaction. sb.mu is held; sets is how many domain sets the node table
// holds for it.
func (m *Manager) moveToShard(sb *sandbox, sets int) error {
	m.nftMu.Lock()
	defer m.nftMu.Unlock()
	n := m.nft
	shard := n.shard(sb.st.Index)
	for k := 0; k < min(sets, sb.st.DomainSets); k++ {
		els, err := n.c.GetSetElements(dsetIn(n.table, domainSet(sb.st.ID, k)))
		if err != nil {
			continue // no such set: nothing to copy
		}
		var keep []nftables.SetElement
		for _, e := range els {
			left := cmp.Or(e.Expires, e.Timeout)
			if left > time.Second {
				keep = append(keep, nftables.SetElement{Key: e.Key, Timeout: left.Truncate(time.Second)})
			}
		}
		if len(keep) > 0 {
			if err := n.c.SetAddElements(dsetIn(shard, domainSet(sb.st.ID, k)), keep); err != nil {
				return fmt.Errorf("copy nft set elements: %w", err)
			}
		}
	}
	if err := n.queueRemove(n.table, sb.st.ID, m.ifNames(sb), max(sets, 16)); err != nil {
		return err
	}
	if err := n.flush(); err != nil {
		return fmt.Errorf("move nft rules of sandbox %s into its shard: %w", sb.st.ID, err)
	}
	return nil
}

// dropLegacyTable removes this node's chains, sets and map entries from the
// table of before node IDs were in the names, and the table itself when no
// other node's are left in it. Recover calls it after the live sandboxes'
// rules are in the node's own table, so they are enforced throughout.
func (m *Manager) dropLegacyTable() error {
	if m.cfg.NodeID == "" {
		return nil // that table is this node's own
	}
	m.nftMu.Lock()
	defer m.nftMu.Unlock()
	tables, err := m.nft.c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list nft tables: %w", err)
	}
	if !slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == tableName }) {
		return nil
	}
	old := &nftState{c: m.nft.c, table: &nftables.Table{Name: tableName, Family: nftables.TableFamilyINet}}
	owners, err := old.leftovers()
	if err != nil {
		return err
	}
	others := 0
	for id, sets := range owners {
		if !m.owns(id) {
			others++
			continue
		}
		if err := old.removeSandbox(id, 0, uniq(HostIfName("", id), HostIfName(m.cfg.NodeID, id)), max(sets, 16)); err != nil {
			return fmt.Errorf("move rules out of nft table %s: %w", tableName, err)
		}
	}
	if others > 0 {
		return nil
	}
	oldTables, err := old.tables()
	if err != nil {
		return err
	}
	for _, t := range oldTables {
		m.nft.c.DelTable(t)
	}
	if err := m.nft.flush(); err != nil {
		return fmt.Errorf("remove nft table %s: %w", tableName, err)
	}
	return nil
}

// Validate checks rules against this node's rule sets without changing
// anything; errors name the field.
func (m *Manager) Validate(rules Rules) error {
	_, err := resolve(rules, m.cfg.RuleSets)
	return err
}
