# A host model of radix_select and radix_pick as patch 1 writes them in
# kernels/lookup.cu (three passes of 11, 11 and 10 bits; one warp's pick,
# lane by lane: the skewed sums, the scan, the owner's walk), checked
# against a sort on random, tied and extreme keys. It says the digits, the
# masks and the pick find the exact k-th largest key; it says nothing about
# the GPU (races, barriers, speed): that needs the run in README.md.
#
#   python3 docs/wip/radix_model.py    # prints "ok 3000"

import random
import struct

SHIFT=[21,10,0]; BINS=[2048,2048,1024]
def pick(tot, bins, shift, prefix, krem):
    per=bins//32
    local=[0]*32
    for lane in range(32):
        lo=bins-(lane+1)*per
        for i in range(per): local[lane]+=tot[lo+((i+lane)&(per-1))]
    incl=[];acc=0
    for lane in range(32): acc+=local[lane]; incl.append(acc)
    k=krem
    owners=[l for l in range(32) if incl[l]-local[l] < k <= incl[l]]
    if not owners: return prefix,krem,False
    owner=owners[0]
    above=incl[owner]-local[owner]
    top=bins-1-owner*per
    for j in range(0,per,32):
        cs=[tot[top-j-l] for l in range(32)]
        x=[];a=0
        for c in cs: a+=c; x.append(a)
        hit=[l for l in range(32) if above+x[l]>=k]
        if hit:
            l=hit[0]; b=top-j-l
            return prefix|(b<<shift), k-(above+x[l]-cs[l]), True
        above+=x[31]
    return prefix,krem,False
def select(keys,k):
    prefix=0;krem=k
    for p in range(3):
        shift,bins=SHIFT[p],BINS[p]
        hmask=0 if p==0 else (0xffffffff<<SHIFT[p-1])&0xffffffff
        tot=[0]*2048
        for key in keys:
            if (key&hmask)==prefix: tot[(key>>shift)&(bins-1)]+=1
        prefix,krem,ok=pick(tot,bins,shift,prefix,krem)
        assert ok
    return prefix
def fkey(f): 
    u=struct.unpack('<I',struct.pack('<f',f))[0]
    return (~u)&0xffffffff if u&0x80000000 else u|0x80000000
random.seed(1)
n_cases=0
for trial in range(3000):
    n=random.choice([1,2,5,100,1000,5000])
    kind=random.random()
    if kind<0.3: keys=[fkey(random.random()**8) for _ in range(n)]
    elif kind<0.6: keys=[fkey(random.choice([0.25,0.5,1e-6,3.0])) for _ in range(n)]
    else: keys=[random.getrandbits(32)|1 for _ in range(n)]
    k=random.randint(1,n)
    want=sorted(keys,reverse=True)[k-1]
    got=select(keys,k)
    assert got==want,(trial,n,k,hex(got),hex(want))
    n_cases+=1
print("ok",n_cases)
