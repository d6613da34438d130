#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into fuzz/corpus/ (committed; rerun after a
format change). Each seed is a valid input the targets' parsers accept, so fuzzing starts deep."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def msg(cmd, payload=b"", flags=0, mid=1):
    return struct.pack("<HHIII", mid, cmd, 16 + len(payload), flags, 0) + payload


VERSION, DMA_MAP, DMA_UNMAP, GET_INFO, REGION_INFO, IRQ_INFO, SET_IRQS = 1, 2, 3, 4, 5, 7, 8
REGION_READ, REGION_WRITE, RESET, WRITE_MULTI = 9, 10, 13, 15
BAR0, BAR4, CONFIG = 0, 4, 7
MEM = 0x10000000


def rw(region, off, data):
    return msg(REGION_WRITE, struct.pack("<QII", off, region, len(data)) + data)


def rd(region, off, n):
    return msg(REGION_READ, struct.pack("<QII", off, region, n))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- vfio_user_messages ----
caps = b'{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":1048576,"write_multiple":true}}\0'
write("vfio_user_messages", "version_json", msg(VERSION, struct.pack("<HH", 0, 0) + caps))
write("vfio_user_messages", "device_info",
      msg(GET_INFO, struct.pack("<IIII", 16, 0, 0, 0)) +
      b"".join(msg(REGION_INFO, struct.pack("<IIIIQQ", 256, 0, i, 0, 0, 0)) for i in range(9)) +
      b"".join(msg(IRQ_INFO, struct.pack("<IIII", 16, 0, i, 0)) for i in range(5)))
write("vfio_user_messages", "config_space",
      rd(CONFIG, 0, 256) + rw(CONFIG, 0x10, b"\xff\xff\xff\xff") + rd(CONFIG, 0x10, 4) +
      rw(CONFIG, 0x52, b"\x00\x80") + rw(CONFIG, 4, b"\x06\x04"))
write("vfio_user_messages", "enable_controller",
      rw(BAR0, 0x24, struct.pack("<I", (3 << 16) | 3)) + rw(BAR0, 0x28, struct.pack("<Q", MEM)) +
      rw(BAR0, 0x30, struct.pack("<Q", MEM + 0x1000)) +
      rw(BAR0, 0x14, struct.pack("<I", 1 | (6 << 4) | (6 << 16) | (4 << 20))) +
      rd(BAR0, 0x1C, 4) + rd(BAR0, 0, 8) + rw(BAR0, 0x1000, struct.pack("<I", 1)) +
      msg(RESET))
write("vfio_user_messages", "dma_and_irqs",
      msg(DMA_MAP, struct.pack("<IIQQQ", 32, 3, 0, 0x20000000, 0x4000)) +
      msg(DMA_UNMAP, struct.pack("<IIQQ", 24, 0, 0x20000000, 0x4000)) +
      msg(DMA_UNMAP, struct.pack("<IIQQ", 24, 2, 0, 0)) +
      msg(SET_IRQS, struct.pack("<IIIII", 20, 1 | 32, 2, 0, 0)) +
      msg(SET_IRQS, struct.pack("<IIIII", 22, 2 | 32, 2, 0, 2) + b"\x01\x00") +
      msg(WRITE_MULTI, struct.pack("<Q", 2) +
          struct.pack("<QII8s", 0x14, BAR0, 4, b"\x00" * 8) +
          struct.pack("<QII8s", 0x0, BAR4, 8, b"\x01" * 8)) +
      rd(BAR4, 0x1000, 8))

# ---- nvme_sqe: 64-byte SQE, control byte, memory image at IOVA 0x100000 ----
IMG = 0x100000


def sqe(opcode, cid=1, nsid=0, prp1=IMG, prp2=0, cdw10=0, cdw11=0, cdw12=0, flags=0):
    return struct.pack("<BBHIQQQQIIIIII", opcode, flags, cid, nsid, 0, 0, prp1, prp2,
                       cdw10, cdw11, cdw12, 0, 0, 0)


img = bytearray(8192)
write("nvme_sqe", "identify_controller", sqe(0x06, cdw10=1) + b"\x00" + bytes(img))
write("nvme_sqe", "identify_kv_ns", sqe(0x06, nsid=1, cdw10=5, cdw11=1 << 24) + b"\x00" + bytes(img))
write("nvme_sqe", "create_cq", sqe(0x05, cdw10=1 | (15 << 16), cdw11=1, cdw12=1 << 31) + b"\x00")
write("nvme_sqe", "get_log_smart", sqe(0x02, nsid=0xFFFFFFFF, cdw10=2 | (127 << 16)) + b"\x00")
write("nvme_sqe", "set_queues", sqe(0x09, cdw10=7, cdw11=(3 << 16) | 3) + b"\x00")
# A PRP list of three pages at IMG + 0x1000.
lst = bytearray(8192)
struct.pack_into("<QQQ", lst, 0x1000, IMG + 0x0000, IMG + 0x1000, IMG + 0x0000)
write("nvme_sqe", "prp_list", sqe(0x02, prp1=IMG + 8, prp2=IMG + 0x1000, cdw10=4 * 4096) +
      b"\x01" + bytes(lst))
# An SGL: a last segment of two data blocks at IMG + 0x200.
sgl = bytearray(8192)
struct.pack_into("<QI3xBQI3xB", sgl, 0x200, IMG, 100, 0x00, IMG + 0x400, 200, 0x00)
write("nvme_sqe", "sgl_last_segment",
      sqe(0x02, flags=0x40, prp1=IMG + 0x200, prp2=struct.unpack("<Q", struct.pack("<I3xB", 32, 0x30))[0],
          cdw10=300) + b"\x01" + bytes(sgl))
write("nvme_sqe", "flat", sqe(0x01, prp1=IMG + 5, cdw10=6000) + b"\x02" + bytes(8192))

# ---- metrics_http ----
write("metrics_http", "get_metrics", b"GET /metrics HTTP/1.1\r\nHost: gdkvd\r\n\r\n")
write("metrics_http", "get_removed_after", b"GET /removed?after=2 HTTP/1.1\r\nHost: gdkvd\r\n\r\n")
write("metrics_http", "head_removed", b"HEAD /removed HTTP/1.0\n\n")
write("metrics_http", "post", b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
