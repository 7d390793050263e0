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

	"github.com/kernflux/opendsec/internal/log"
)

// dnsProxy is the node's resolver for sandboxes. It knows the asking
// sandbox by the query's source address (spoofing is dropped by nftables).
type dnsProxy struct {
	m        *Manager
	ctx      context.Context
	udp, tcp *dns.Server
}

func startDNS(ctx context.Context, m *Manager) (*dnsProxy, error) {
	p := &dnsProxy{m: m, ctx: context.WithoutCancel(ctx)}
	addr := netip.AddrPortFrom(m.alloc.dnsAddr(), 53).String()
	var pc net.PacketConn
	var ln net.Listener
	// The sockets are opened in the node namespace and stay there.
	err := inNetNS(m.cfg.NodeNetNS, func() error {
		var err error
		if pc, err = net.ListenPacket("udp4", addr); err != nil {
			return fmt.Errorf("listen dns udp: %w", err)
		}
		if ln, err = net.Listen("tcp4", addr); err != nil {
			pc.Close()
			return fmt.Errorf("listen dns tcp: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	p.udp = &dns.Server{PacketConn: pc, Handler: p}
	p.tcp = &dns.Server{Listener: ln, Handler: p}
	started := make(chan struct{}, 2)
	p.udp.NotifyStartedFunc = func() { started <- struct{}{} }
	p.tcp.NotifyStartedFunc = func() { started <- struct{}{} }
	go p.udp.ActivateAndServe()
	go p.tcp.ActivateAndServe()
	for range 2 {
		select {
		case <-started:
		case <-ctx.Done():
			p.close()
			return nil, ctx.Err()
		}
	}
	return p, nil
}

func (p *dnsProxy) close() error {
	return errors.Join(p.udp.Shutdown(), p.tcp.Shutdown())
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
	if req.Opcode != dns.OpcodeQuery || len(req.Question) != 1 {
		reply(w, req, dns.RcodeFormatError)
		return
	}
	q := req.Question[0]
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	sb.mu.Lock()
	var sets []int
	k := 0
	for _, r := range sb.rules {
		if !r.isDomain() {
			continue
		}
		if r.matches(name) {
			sets = append(sets, k)
		}
		k++
	}
	sb.mu.Unlock()
	// A name no rule allows is never sent upstream: DNS carries nothing out.
	if len(sets) == 0 || q.Qclass != dns.ClassINET {
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
	var addrs []netip.Addr
	ttl := uint32(0)
	for _, rr := range resp.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok {
				addrs = append(addrs, ip)
				if ttl == 0 || a.Hdr.Ttl < ttl {
					ttl = a.Hdr.Ttl
				}
			}
		}
	}
	if len(addrs) > 0 {
		if err := p.m.admit(sb, name, addrs, time.Duration(ttl)*time.Second); err != nil {
			log.G(ctx).Warn("admit resolved addresses", "sandbox.id", sb.net.ID, "name", name, "error", err)
			reply(w, req, dns.RcodeServerFailure)
			return
		}
	}
	resp.Id = req.Id
	w.WriteMsg(resp)
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

// admit records addrs for name and adds them to every domain set of sb
// whose rule matches name, for at least the configured minimum TTL.
func (m *Manager) admit(sb *sandbox, name string, addrs []netip.Addr, ttl time.Duration) error {
	if min := time.Duration(m.cfg.MinTTLSeconds) * time.Second; ttl < min {
		ttl = min
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var sets []int
	k := 0
	for _, r := range sb.rules {
		if !r.isDomain() {
			continue
		}
		if r.matches(name) {
			sets = append(sets, k)
		}
		k++
	}
	if len(sets) == 0 {
		return nil // rules changed while the query was upstream
	}
	exp := time.Now().Add(ttl)
	for _, a := range addrs {
		sb.learned = append(sb.learned, learned{name: name, addr: a, expires: exp})
	}
	m.nftMu.Lock()
	defer m.nftMu.Unlock()
	return m.nft.admit(sb.st.ID, sets, addrs, ttl)
}
