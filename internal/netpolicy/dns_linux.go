package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// dnsProxy is the node's resolver for sandboxes. It knows the asking
// sandbox by the query's source address (spoofing is dropped by nftables).
type dnsProxy struct {
	m        *Manager
	ctx      context.Context
	pc       net.PacketConn
	ln       net.Listener
	udp, tcp *dns.Server // nil until serve
	// served gets each server's ActivateAndServe result once it returned,
	// which is after its socket is closed (see close).
	served chan error
}

// listenDNS opens the proxy's sockets (queries wait in them until serve).
// It runs before the node changes anything in its namespace, so a node
// whose address another node holds fails without touching it.
func listenDNS(ctx context.Context, m *Manager) (*dnsProxy, error) {
	p := &dnsProxy{m: m, ctx: context.WithoutCancel(ctx)}
	addr := netip.AddrPortFrom(m.alloc.dnsAddr(), 53).String()
	// The sockets are opened in the node namespace and stay there.
	err := inNetNS(m.cfg.NodeNetNS, func() error {
		var err error
		if p.pc, err = net.ListenPacket("udp4", addr); err != nil {
			return fmt.Errorf("listen dns udp: %w", err)
		}
		if p.ln, err = net.Listen("tcp4", addr); err != nil {
			p.pc.Close()
			return fmt.Errorf("listen dns tcp: %w", err)
		}
		return nil
	})
	if errors.Is(err, unix.EADDRINUSE) {
		// A configuration error, so the node does not start without
		// network (which it does when this machine cannot run it).
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "network.pool: the DNS proxy's address %s is taken, most likely by another node in this network namespace with the same pool; give each node its own network.pool or network.node_netns: %w", addr, err)
	}
	if err != nil {
		return nil, err
	}
	return p, nil
}

// serve answers queries on the sockets listenDNS opened.
func (p *dnsProxy) serve(ctx context.Context) error {
	p.udp = &dns.Server{PacketConn: p.pc, Handler: p}
	p.tcp = &dns.Server{Listener: p.ln, Handler: p}
	started := make(chan struct{}, 2)
	p.udp.NotifyStartedFunc = func() { started <- struct{}{} }
	p.tcp.NotifyStartedFunc = func() { started <- struct{}{} }
	p.served = make(chan error, 2)
	go func() { p.served <- p.udp.ActivateAndServe() }()
	go func() { p.served <- p.tcp.ActivateAndServe() }()
	for range 2 {
		select {
		case <-started:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// close stops the proxy and returns once both sockets are closed, so a
// Manager started next in the same namespace can bind the address. The
// server's Shutdown alone does not promise that: the serve loop closes
// the socket too, and of two concurrent Closes of one Go socket the one
// that comes second returns at once, before the first has closed the
// descriptor. Shutdown could thus return with the port still bound (seen
// as "address already in use" on restart under load). ActivateAndServe
// returns only after the loop's own Close, so waiting for both serve
// goroutines covers whichever Close came first.
func (p *dnsProxy) close() error {
	if p.udp == nil {
		return errors.Join(p.pc.Close(), p.ln.Close())
	}
	err := errors.Join(p.udp.Shutdown(), p.tcp.Shutdown())
	// A server that had not started yet (serve's ctx ended first) is not
	// shut down by Shutdown; closing its socket ends it either way. Every
	// Close has returned once both goroutines have: only then is the port
	// free.
	p.pc.Close()
	p.ln.Close()
	for range 2 {
		// The servers' own errors after a shutdown are not the caller's.
		if serr := <-p.served; serr != nil {
			log.G(p.ctx).Debug("dns proxy server ended", log.Err(serr))
		}
	}
	return err
}

func reply(w dns.ResponseWriter, req *dns.Msg, rcode int) {
	r := new(dns.Msg)
	r.SetRcode(req, rcode)
	r.RecursionAvailable = true
	w.WriteMsg(r)
}

// ServeDNS answers one query from a sandbox.
func (p *dnsProxy) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	src, _ := netip.ParseAddrPort(w.RemoteAddr().String())
	sb := p.m.bySource(src.Addr().Unmap())
	if sb == nil {
		reply(w, req, dns.RcodeRefused)
		return
	}
	now := time.Now()
	sb.mu.Lock()
	if !sb.queries.allow(now, p.m.cfg.DNSQueriesPerSecond, p.m.cfg.DNSQueryBurst) {
		sb.refused++
		if now.Sub(sb.loggedAt) >= time.Minute {
			log.G(p.ctx).Warn("dns queries over the rate limit refused", "sandbox.id", sb.st.ID,
				"refused", sb.refused, "queries_per_second", p.m.cfg.DNSQueriesPerSecond, "burst", p.m.cfg.DNSQueryBurst)
			sb.refused, sb.loggedAt = 0, now
		}
		sb.mu.Unlock()
		p.m.dnsRateLimited.Add(1)
		reply(w, req, dns.RcodeRefused)
		return
	}
	sb.mu.Unlock()
	if req.Opcode != dns.OpcodeQuery || len(req.Question) != 1 {
		reply(w, req, dns.RcodeFormatError)
		return
	}
	q := req.Question[0]
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	sb.mu.Lock()
	matched := false
	for _, r := range sb.rules {
		if r.isDomain() && r.matches(name) {
			matched = true
			break
		}
	}
	sb.mu.Unlock()
	// A name no rule allows is never sent upstream: DNS carries nothing out.
	if !matched || q.Qclass != dns.ClassINET {
		reply(w, req, dns.RcodeNameError)
		return
	}
	if q.Qtype == dns.TypeAAAA {
		// IPv6 is off inside sandboxes: an empty answer makes clients use A.
		reply(w, req, dns.RcodeSuccess)
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, 5*time.Second)
	defer cancel()
	resp, err := p.forward(ctx, req, w.RemoteAddr().Network() == "tcp")
	if err != nil {
		log.G(ctx).Warn("dns upstream", "sandbox.id", sb.net.ID, "name", name, "error", err)
		reply(w, req, dns.RcodeServerFailure)
		return
	}
	dropped, kept, err := p.m.admit(sb, name, resp)
	if err != nil {
		log.G(ctx).Warn("admit resolved addresses", "sandbox.id", sb.net.ID, "name", name, "error", err)
		reply(w, req, dns.RcodeServerFailure)
		return
	}
	if dropped > 0 {
		p.m.dnsPrivate.Add(1)
		if kept == 0 {
			// Every address was private: say so rather than answer nothing.
			r := new(dns.Msg)
			r.SetRcode(req, dns.RcodeRefused)
			r.RecursionAvailable = true
			withEDE(r, req, dns.ExtendedErrorCodeBlocked, "private addresses are refused for domain rules (node.network.refuse_private_dns_answers)")
			w.WriteMsg(r)
			return
		}
		withEDE(resp, req, dns.ExtendedErrorCodeFiltered, "private addresses removed for domain rules (node.network.refuse_private_dns_answers)")
	}
	resp.Id = req.Id
	w.WriteMsg(resp)
}

// withEDE adds an extended DNS error (RFC 8914) to r when the query spoke
// EDNS.
func withEDE(r, req *dns.Msg, code uint16, text string) {
	if req.IsEdns0() == nil {
		return
	}
	opt := r.IsEdns0()
	if opt == nil {
		r.SetEdns0(dns.DefaultMsgSize, false)
		opt = r.IsEdns0()
	}
	opt.Option = append(opt.Option, &dns.EDNS0_EDE{InfoCode: code, ExtraText: text})
}

// privateRanges are what RefusePrivateDNSAnswers keeps out of answers for
// domain rules (the node's pool lies in 100.64.0.0/10; it is checked too).
var privateRanges = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),      // "this network"
	netip.MustParsePrefix("10.0.0.0/8"),     // RFC 1918
	netip.MustParsePrefix("100.64.0.0/10"),  // RFC 6598 shared space (CGNAT, sandbox pools)
	netip.MustParsePrefix("127.0.0.0/8"),    // loopback
	netip.MustParsePrefix("169.254.0.0/16"), // link-local, cloud metadata
	netip.MustParsePrefix("172.16.0.0/12"),  // RFC 1918
	netip.MustParsePrefix("192.168.0.0/16"), // RFC 1918
	netip.MustParsePrefix("224.0.0.0/4"),    // multicast
	netip.MustParsePrefix("240.0.0.0/4"),    // reserved, broadcast
}

func (m *Manager) isPrivate(a netip.Addr) bool {
	if m.pool.Contains(a) {
		return true
	}
	for _, p := range privateRanges {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// forward asks the upstream servers in turn, from the node namespace.
func (p *dnsProxy) forward(ctx context.Context, req *dns.Msg, useTCP bool) (*dns.Msg, error) {
	if len(p.m.cfg.Upstream) == 0 {
		return nil, fmt.Errorf("no dns upstream configured (network.dns_upstream)")
	}
	var errs []error
	for _, up := range p.m.cfg.Upstream {
		resp, err := p.exchange(ctx, req, up, useTCP)
		if err == nil && resp.Truncated && !useTCP {
			resp, err = p.exchange(ctx, req, up, true)
		}
		if err == nil {
			return resp, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

func (p *dnsProxy) exchange(ctx context.Context, req *dns.Msg, upstream string, useTCP bool) (*dns.Msg, error) {
	network := "udp"
	if useTCP {
		network = "tcp"
	}
	var c net.Conn
	err := inNetNS(p.m.cfg.NodeNetNS, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, network, upstream)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial dns upstream: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	client := &dns.Client{Net: network}
	resp, _, err := client.ExchangeWithConnContext(ctx, req, &dns.Conn{Conn: c})
	if err != nil {
		return nil, fmt.Errorf("query dns upstream %s: %w", upstream, err)
	}
	return resp, nil
}

// admit adds the A records of resp (an answer for name) to every domain
// set of sb whose rule matches name, for their TTL clamped to the
// configured bounds, and returns once the kernel has them. With
// RefusePrivateDNSAnswers it first removes private addresses from resp
// (unless a CIDR rule of sb covers them: those stay in the answer and are
// left to that rule) and reports how many it removed and how many A
// records are left.
func (m *Manager) admit(sb *sandbox, name string, resp *dns.Msg) (dropped, kept int, err error) {
	sb.mu.Lock()
	var addrs []netip.Addr
	ttl := uint32(0)
	answer := resp.Answer[:0]
	for _, rr := range resp.Answer {
		a, ok := rr.(*dns.A)
		if !ok {
			answer = append(answer, rr)
			continue
		}
		ip, ok := netip.AddrFromSlice(a.A.To4())
		if !ok {
			continue
		}
		if m.cfg.RefusePrivateDNSAnswers && m.isPrivate(ip) {
			if !coveredByCIDR(sb.rules, ip) {
				dropped++
				continue
			}
			answer = append(answer, rr)
			kept++
			continue
		}
		answer = append(answer, rr)
		kept++
		addrs = append(addrs, ip)
		if ttl == 0 || a.Hdr.Ttl < ttl {
			ttl = a.Hdr.Ttl
		}
	}
	resp.Answer = answer
	matched := false
	for _, r := range sb.rules {
		if r.isDomain() && r.matches(name) {
			matched = true
			break
		}
	}
	if len(addrs) == 0 || !matched {
		// Nothing to admit, or the rules changed while the query was
		// upstream.
		sb.mu.Unlock()
		return dropped, kept, nil
	}
	ops := m.learn(sb, name, addrs, time.Duration(ttl)*time.Second, time.Now())
	done := m.enqueue(sb, ops)
	sb.mu.Unlock()
	if err := m.wait(done); err != nil {
		return dropped, kept, fmt.Errorf("admit resolved addresses: %w", err)
	}
	return dropped, kept, nil
}

// coveredByCIDR reports whether a CIDR rule of rules contains a.
func coveredByCIDR(rules []rule, a netip.Addr) bool {
	for _, r := range rules {
		if !r.isDomain() && r.prefix.Contains(a) {
			return true
		}
	}
	return false
}
