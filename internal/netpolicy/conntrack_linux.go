package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// ctnetlink's dump filter (linux/netfilter/nfnetlink_conntrack.h, kernel
// 5.8 and later), which vishvananda/netlink does not wrap.
const (
	ctaFilter           = 25 // CTA_FILTER
	ctaFilterOrigFlags  = 1  // CTA_FILTER_ORIG_FLAGS
	ctaFilterReplyFlags = 2  // CTA_FILTER_REPLY_FLAGS
	ctaFilterFlagIPSrc  = 1 << 0
	ctaZone             = 18 // CTA_ZONE
)

// conntrackDeleteFrom deletes the node's IPv4 conntrack entries whose
// original source is src, in the network namespace ns ("" the caller's),
// and returns how many it deleted.
//
// netlink.ConntrackDeleteFilters dumps the whole table to user space and
// filters there: O(entries on the node) for every sandbox stopped, 11-21%
// of the node's CPU in a burst of stops (bench/results/2026-12-02-burst-profile.md).
// This asks the kernel to filter the dump by source address (CTA_FILTER),
// so only the sandbox's own entries come back, and deletes each by its
// tuple. A kernel without CTA_FILTER ignores it and dumps everything: each
// entry's source is checked again here, so nothing else is ever deleted.
func conntrackDeleteFrom(ns string, src netip.Addr) (int, error) {
	if !src.Is4() {
		return 0, fmt.Errorf("conntrack flush: %s is not an IPv4 address", src)
	}
	n := 0
	err := inNetNS(ns, func() error {
		req := nl.NewNetlinkRequest((int(netlink.ConntrackTable)<<8)|nl.IPCTNL_MSG_CT_GET, unix.NLM_F_DUMP)
		req.AddData(&nl.Nfgenmsg{NfgenFamily: unix.AF_INET, Version: nl.NFNETLINK_V0})
		filter := nl.NewRtAttr(ctaFilter|unix.NLA_F_NESTED, nil)
		filter.AddRtAttr(ctaFilterOrigFlags, nl.Uint32Attr(ctaFilterFlagIPSrc))
		filter.AddRtAttr(ctaFilterReplyFlags, nl.Uint32Attr(0))
		req.AddData(filter)
		a := src.As4()
		tuple := nl.NewRtAttr(nl.CTA_TUPLE_ORIG|unix.NLA_F_NESTED, nil)
		tuple.AddRtAttr(nl.CTA_TUPLE_IP|unix.NLA_F_NESTED, nil).AddRtAttr(nl.CTA_IP_V4_SRC, a[:])
		req.AddData(tuple)
		msgs, err := req.Execute(unix.NETLINK_NETFILTER, 0)
		if err != nil {
			return fmt.Errorf("dump conntrack entries of %s: %w", src, err)
		}
		var errs []error
		for _, m := range msgs {
			keys, ok := conntrackKeysFrom(m, a)
			if !ok {
				continue
			}
			del := nl.NewNetlinkRequest((int(netlink.ConntrackTable)<<8)|nl.IPCTNL_MSG_CT_DELETE, unix.NLM_F_ACK)
			del.AddData(&nl.Nfgenmsg{NfgenFamily: unix.AF_INET, Version: nl.NFNETLINK_V0})
			for _, k := range keys {
				del.AddData(k)
			}
			if _, err := del.Execute(unix.NETLINK_NETFILTER, 0); err != nil {
				if !errors.Is(err, unix.ENOENT) { // gone meanwhile
					errs = append(errs, fmt.Errorf("delete conntrack entry of %s: %w", src, err))
				}
				continue
			}
			n++
		}
		return errors.Join(errs...)
	})
	return n, err
}

// conntrackKeysFrom returns the attributes that name the entry of dump
// message m (its original tuple, its zone) when its original source is
// src; false otherwise.
func conntrackKeysFrom(m []byte, src [4]byte) ([]nl.NetlinkRequestData, bool) {
	const nfgenmsgLen = 4
	if len(m) < nfgenmsgLen {
		return nil, false
	}
	attrs, err := nl.ParseRouteAttr(m[nfgenmsgLen:])
	if err != nil {
		return nil, false
	}
	var keys []nl.NetlinkRequestData
	match := false
	for _, at := range attrs {
		switch at.Attr.Type & nl.NLA_TYPE_MASK {
		case nl.CTA_TUPLE_ORIG:
			match = tupleSourceIs(at.Value, src)
			keys = append(keys, nl.NewRtAttr(nl.CTA_TUPLE_ORIG|unix.NLA_F_NESTED, at.Value))
		case ctaZone:
			keys = append(keys, nl.NewRtAttr(ctaZone, at.Value))
		}
	}
	return keys, match
}

// tupleSourceIs reports whether a CTA_TUPLE_ORIG payload has source src.
func tupleSourceIs(tuple []byte, src [4]byte) bool {
	attrs, err := nl.ParseRouteAttr(tuple)
	if err != nil {
		return false
	}
	for _, at := range attrs {
		if at.Attr.Type&nl.NLA_TYPE_MASK != nl.CTA_TUPLE_IP {
			continue
		}
		ips, err := nl.ParseRouteAttr(at.Value)
		if err != nil {
			return false
		}
		for _, ip := range ips {
			if ip.Attr.Type&nl.NLA_TYPE_MASK == nl.CTA_IP_V4_SRC {
				return len(ip.Value) == 4 && [4]byte(ip.Value) == src
			}
		}
	}
	return false
}
