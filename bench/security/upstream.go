package main

import (
	"context"
	"net"

	"github.com/miekg/dns"
)

// upstreamAnswer is the address every A query gets. It is a public unicast
// address (a node that refuses private answers keeps it); nothing is ever
// sent to it: it only lands in the sandbox's nftables set.
var upstreamAnswer = net.IPv4(17, 0, 0, 1)

// serveUpstream answers every A query for any name with upstreamAnswer
// (TTL 300) until ctx ends.
func serveUpstream(ctx context.Context, addr string) error {
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return err
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(req)
		for _, q := range req.Question {
			if q.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300}, A: upstreamAnswer})
			}
		}
		_ = w.WriteMsg(m)
	})}
	go func() {
		<-ctx.Done()
		_ = srv.Shutdown()
	}()
	if err := srv.ActivateAndServe(); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}
